/**
 * The send scheduler of one KV connection, sans-IO: the running transfers (`sendFrom`) take
 * turns handing pieces to the connection, deficit round robin (Shreedhar & Varghese, "Efficient
 * fair queuing using deficit round robin", SIGCOMM 1995) with the credit reset rather than
 * accumulated at each turn. It touches no socket and no timer: each transfer writes through its
 * own `step()`, and the owner's `gate(turnBytes)` says whether the window has room. `PeerConn`
 * (connection.ts) runs it over its sockets; the simulator (../sim) over its fake links.
 */
import type { Timers } from '../base/clock.js';
import { errText, type KvLog } from './conn-core.js';
import { encodeChunk } from './frame.js';
import { MAX_CHUNK_BYTES } from './messages.js';
import { KvError, type RoomId } from './types.js';

/**
 * Bytes a transfer may hand the socket per turn of its connection's send rotation (its credit,
 * spent in whole pieces: it writes while credit is left), 2 × MAX_CHUNK_BYTES = 2 MiB. A
 * transfer that runs dry in its turn (all its pooled pieces in flight: the file sender has at
 * most 1 MiB out) keeps the credit it has left and is served first as soon as it has a piece
 * again, before the rotation goes on. So a state of up to about 2 MiB (envelope head, payload
 * pieces, trailer), once its turn comes, goes out without a whole rotation of other rooms' bytes
 * between its first and its last.
 */
export const SEND_QUANTUM_BYTES = 2 * MAX_CHUNK_BYTES;

/** Options of PeerConn.sendChunks / sendFrom. */
export interface SendChunksOptions {
  /** Data bytes per chunk frame, 1..MAX_CHUNK_BYTES (default MAX_CHUNK_BYTES). */
  chunkBytes?: number;
  /** Aborting rejects with KvError('ABORTED'). Chunks already queued are still delivered. */
  signal?: AbortSignal;
  /** Max time without progress (a chunk flushed to the kernel), ms (default 10000); then KvError('TIMEOUT'). */
  stallMs?: number;
  /** Called with the data bytes of each chunk once flushed to the kernel (a delta, not a total). */
  onProgress?: (bytes: number) => void;
  /** Offset of `blob`'s first byte in the room's byte stream (default 0): a transfer sent in pieces. */
  offset?: number;
}

/**
 * What `PeerConn.sendFrom` pulls pieces from. `next()`: a piece, `null` (none ready now),
 * `undefined` (the end). `flushed(piece)`: the socket is done with a piece. `attach(resume)`:
 * called once at the start by a source that can have nothing ready with nothing in flight (a
 * file still being written): it calls `resume()` when it may have bytes again, and bounds its
 * own waits (sendFrom's stall timer restarts on every resume). Without `attach`, `null` with
 * nothing in flight is an error.
 */
export interface ChunkSource {
  next(): Buffer | null | undefined;
  flushed?(piece: Buffer): void;
  attach?(resume: () => void): void;
}

/** One running transfer as its connection's send rotation sees it. */
export interface Outgoing {
  /** False after its source returned null: skipped until a flush of its own or the source's resume. */
  ready: boolean;
  /** Bytes it may still write in its current turn (the quantum when the turn starts; kept when it runs dry). */
  credit: number;
  /** Hands the connection the source's next piece: its bytes, or 0 (nothing ready, the end, or the transfer settled: it then calls `drop`). */
  step(): number;
  /** The connection made progress: restart the stall timer. */
  alive(): void;
  /** The connection is gone: settle with PEER_LOST. */
  lost(): void;
}

/**
 * The rotation: `add` a transfer, `drop` it when it ends or settles, `serve()` whenever the
 * window may have room (a flush, 'drain', a new transfer, a source's resume, a new turn).
 * `gate(turnBytes)` is asked before every step with the bytes handed over since `newTurn()`;
 * false stops this round (the owner serves again when there is room, and settles every transfer
 * through `lost()` when the connection is gone).
 */
export class SendRotation {
  /** Running transfers in rotation order. */
  readonly sending: Outgoing[] = [];
  /** Bytes handed over since the last `newTurn()`. */
  turnBytes = 0;
  /** Index in `sending` of the transfer whose turn it is, and that transfer (its turn started). */
  private cursor = 0;
  private turnOwner: Outgoing | undefined;
  private serving = false;
  private again = false;

  /**
   * @param gate whether the owner may take more bytes now
   * @param quantumBytes credit per turn (SEND_QUANTUM_BYTES in the workers; the simulator uses a small one)
   */
  constructor(
    private readonly gate: (turnBytes: number) => boolean,
    readonly quantumBytes: number = SEND_QUANTUM_BYTES,
  ) {}

  /** A new transfer joins the end of the rotation. */
  add(o: Outgoing): void {
    this.sending.push(o);
  }

  /** Takes a transfer out of the rotation (ended or settled); the turn stays with the next one. */
  drop(o: Outgoing): void {
    const i = this.sending.indexOf(o);
    if (i < 0) return;
    this.sending.splice(i, 1);
    if (i < this.cursor) this.cursor--;
    if (this.turnOwner === o) this.turnOwner = undefined;
  }

  /** A new event-loop turn: the per-turn byte count restarts. */
  newTurn(): void {
    this.turnBytes = 0;
  }

  /**
   * Fills the window from the running transfers, in turns: first any transfer that ran dry in
   * its turn with credit left and has a piece again, up to that credit; then the transfer whose
   * turn it is writes pieces until it has spent its credit or has nothing ready, then the next
   * one. Re-entrant calls (from a source or a settle) loop once more when back.
   */
  serve(): void {
    if (this.serving) {
      this.again = true;
      return;
    }
    this.serving = true;
    try {
      do {
        this.again = false;
        this.round();
      } while (this.again);
    } finally {
      this.serving = false;
    }
  }

  private round(): void {
    const list = this.sending;
    // 1. transfers that ran dry in their turn with credit left go first, up to that credit
    for (let i = 0; i < list.length; ) {
      if (!this.gate(this.turnBytes)) return;
      const o = list[i];
      if (o.ready && o.credit > 0 && i !== this.cursor) {
        const n = o.step();
        if (list[i] !== o) continue; // it ended or settled: list[i] is the next one now
        if (n > 0) {
          o.credit -= n;
          this.turnBytes += n;
          continue;
        }
      }
      i++;
    }
    // 2. the rotation
    let idle = 0; // transfers in a row that had nothing to write
    while (list.length > 0) {
      if (!this.gate(this.turnBytes)) return;
      if (this.cursor >= list.length) this.cursor = 0;
      const o = list[this.cursor];
      if (this.turnOwner !== o) {
        this.turnOwner = o; // its turn starts
        o.credit = this.quantumBytes;
      }
      const n = o.ready ? o.step() : 0;
      if (list[this.cursor] !== o) {
        idle = 0; // it ended or settled (drop moved the cursor to the next one)
        continue;
      }
      if (n > 0) {
        idle = 0;
        this.turnBytes += n;
        o.credit -= n;
        if (o.credit > 0) continue;
        o.credit = 0;
      } else if (++idle >= list.length) return; // nobody has a piece ready
      this.cursor++; // the next one's turn (a dry one keeps its credit: step 1 serves it)
      this.turnOwner = undefined; // a new turn starts there, even when the rotation is back at the same transfer
    }
  }
}

/** What one transfer needs of its connection (PeerConn, or the simulator's connection). */
export interface TransferHost {
  readonly rotation: SendRotation;
  readonly timers: Timers;
  readonly log: KvLog;
  /** The connection's name, for log lines. */
  readonly name: string;
  /** Authenticated and not closing. */
  readonly open: boolean;
  /**
   * Hands one chunk frame to the connection (the next socket of a striped one); `done` runs once
   * the transport is done with it (`err` when it never reached the kernel). 'gone': not handed
   * over (`done` never runs); false: handed over but the connection failed on it.
   */
  writeChunk(frame: Buffer[], done: (err?: Error | null) => void): boolean | 'gone';
  /** The PEER_LOST error of a transfer of `room` (`err`: the write failure, if any). */
  lostError(room: RoomId, err?: Error): KvError;
  /** Calls `fn` once when the connection ends; returns the un-registration. */
  onEnd(fn: () => void): () => void;
}

const reasonText = (r: unknown): string => (r instanceof Error ? r.message : r === undefined ? 'aborted' : String(r));

/**
 * Streams the pieces `source.next()` yields as chunk frames of room `roomId` over `host`, one
 * frame per piece at contiguous offsets from `opts.offset`, taking turns with the connection's
 * other transfers (`host.rotation`). See `PeerConn.sendFrom` for the contract (what resolves,
 * what rejects, when `flushed` and `onProgress` run, what restarts the stall timer). Rejects
 * with KvError 'PEER_LOST', 'ABORTED', 'TIMEOUT', 'BAD_FRAME' or 'BAD_STATE'; RangeError for
 * a bad `stallMs`.
 */
export function sendFrom(host: TransferHost, roomId: RoomId, source: ChunkSource, opts: SendChunksOptions = {}): Promise<void> {
  const stallMs = opts.stallMs ?? 10_000;
  if (!Number.isSafeInteger(stallMs) || stallMs < 1) return Promise.reject(new RangeError(`stallMs must be a positive integer, got ${stallMs}`));
  try {
    encodeChunk(roomId, 0, Buffer.alloc(1)); // validates the room id up front
  } catch (e) {
    return Promise.reject(e);
  }
  const signal = opts.signal;
  if (signal?.aborted) return Promise.reject(new KvError('ABORTED', `transfer of room ${roomId} aborted before start: ${reasonText(signal.reason)}`));
  if (!host.open) return Promise.reject(host.lostError(roomId));
  const rotation = host.rotation;

  return new Promise<void>((resolve, reject) => {
    let offset = opts.offset ?? 0;
    let pending = 0;
    let flushed = 0;
    let ended = false;
    let done = false;
    let cancelStall: () => void = () => {};
    const armStall = (): void => {
      cancelStall();
      cancelStall = host.timers.after(stallMs, () => settle(new KvError('TIMEOUT', `transfer of room ${roomId} stalled: no progress for ${stallMs} ms (${flushed} bytes flushed)`)));
    };
    let offEnd: () => void = () => {};
    const settle = (err?: Error): void => {
      if (done) return;
      done = true;
      cancelStall();
      rotation.drop(out);
      offEnd();
      signal?.removeEventListener('abort', onAbort);
      if (err) reject(err);
      else resolve();
    };
    const onAbort = (): void => settle(new KvError('ABORTED', `transfer of room ${roomId} aborted: ${reasonText(signal?.reason)}`));
    const onLost = (): void => settle(host.lostError(roomId));
    const giveBack = (piece: Buffer): void => {
      if (!source.flushed) return;
      try {
        source.flushed(piece);
      } catch (e) {
        host.log.error({ peer: host.name, room: roomId, err: errText(e) }, 'kv sendFrom flushed() threw');
      }
    };
    const written =
      (piece: Buffer) =>
      (err?: Error | null): void => {
        pending--;
        giveBack(piece);
        if (!done) {
          if (err) settle(host.lostError(roomId, err));
          else {
            flushed += piece.length;
            armStall();
            if (opts.onProgress) {
              try {
                opts.onProgress(piece.length);
              } catch (e) {
                host.log.error({ peer: host.name, room: roomId, err: errText(e) }, 'kv sendChunks onProgress threw');
              }
            }
            if (ended && pending === 0) settle();
            else out.ready = true; // a piece back: the source may have one again
          }
        }
        if (!err) for (const o of rotation.sending) if (o.ready) o.alive(); // the connection moves: rooms waiting for their turn are not stalled
        rotation.serve(); // room in the window: a room with credit left first, then whoever's turn it is
      };
    const step = (): number => {
      if (done || ended) return 0;
      let piece: Buffer | null | undefined;
      out.ready = false; // before next(): a resume called from inside next() sets it again (no lost wake-up)
      try {
        piece = source.next();
      } catch (e) {
        settle(e as Error);
        return 0;
      }
      if (piece === undefined) {
        ended = true;
        rotation.drop(out); // nothing more to write; settles when the last piece is flushed
        if (pending === 0) settle();
        return 0;
      }
      if (piece === null) {
        // not ready until a flush of ours (or the source's resume, through attach)
        if (pending === 0 && !source.attach) settle(new KvError('BAD_STATE', `transfer of room ${roomId}: the source has nothing to send and nothing in flight`));
        return 0;
      }
      let frame: Buffer[];
      try {
        frame = encodeChunk(roomId, offset, piece);
      } catch (e) {
        giveBack(piece); // never handed to the socket: back to its owner now (a pooled buffer)
        settle(e as Error);
        return 0;
      }
      out.ready = true;
      pending++; // from here the socket owns the piece until written() (called on destroy too)
      const w = host.writeChunk(frame, written(piece));
      if (w === 'gone') {
        pending--;
        giveBack(piece);
        settle(host.lostError(roomId));
        return 0;
      }
      offset += piece.length;
      if (!w) {
        settle(host.lostError(roomId));
        return 0;
      }
      return piece.length;
    };
    const out: Outgoing = {
      ready: true,
      credit: 0,
      step,
      alive: () => {
        if (!done) armStall();
      },
      lost: onLost,
    };
    armStall();
    rotation.add(out);
    offEnd = host.onEnd(onLost);
    signal?.addEventListener('abort', onAbort, { once: true });
    source.attach?.(() => {
      if (done) return;
      armStall();
      out.ready = true;
      rotation.serve();
    });
    rotation.serve();
  });
}
