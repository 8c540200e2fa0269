/**
 * Framing of the prefill↔decode channel (see messages.ts for the wire format).
 *
 *   frame = u32 BE length of (type byte + body) | u8 type | body
 *   type 1 (control): body = UTF-8 JSON of a ControlMsg, 1..MAX_CONTROL_BYTES bytes.
 *   type 2 (chunk):   body = u64 BE room | u64 BE offset | data (1..MAX_CHUNK_BYTES bytes).
 *
 * Encoding validates what it writes (a bug at the sender fails at the sender); decoding is an
 * explicit state machine (header → body) with hard caps checked on the 5-byte header, before any
 * body byte is buffered, so a hostile or broken peer can make us hold at most one capped frame.
 * Every decoding problem is a KvError('BAD_FRAME', reason); nothing else is ever thrown.
 */
import { z } from 'zod';
import { FRAME_CHUNK, FRAME_CONTROL, MAX_CHUNK_BYTES, MAX_CONTROL_BYTES, MAX_KV_STREAMS, type ControlMsg } from './messages.js';
import { isRoomId, parseRoomId, type RoomId } from '../base/room-id.js';
import { KvError } from './types.js';

/** Bytes of the frame header: u32 length + u8 type. */
export const FRAME_HEADER_BYTES = 5;
/** Bytes of a chunk body before its data: u64 room + u64 offset. */
export const CHUNK_PREFIX_BYTES = 16;
/** Longest `reason` carried by fail / auth_fail, characters. encodeControl truncates longer ones. */
export const MAX_REASON_CHARS = 4096;

export { isRoomId };

/**
 * Canonical form of a room id given as a decimal string or a non-negative integer ("007" → "7"),
 * through the one canonicaliser (`parseRoomId`). Chunk frames carry the room as a u64, so only
 * canonical ids survive a round trip. Throws KvError('BAD_FRAME') if not a u64.
 */
export function normalizeRoomId(id: string | number | bigint): RoomId {
  const r = parseRoomId(id);
  if (r === undefined) {
    const outOfRange = (typeof id === 'number' && Number.isSafeInteger(id)) || (typeof id === 'string' && /^[0-9]{1,20}$/.test(id)) || typeof id === 'bigint';
    throw new KvError('BAD_FRAME', `room id ${JSON.stringify(String(id)).slice(0, 40)} ${outOfRange ? 'is out of u64 range' : 'is not a decimal u64'}`);
  }
  return r;
}

// ---------------------------------------------------------------------------------------------
// Control message schemas (one per ControlMsg variant). Unknown keys are stripped, not refused,
// so a later minor version may add optional fields; missing/mistyped fields are refused.

const hex = (min: number, max: number) => z.string().min(min).max(max).regex(/^[0-9a-f]+$/, 'must be lowercase hex');
const nonce = hex(32, 128);
const epoch = hex(8, 64);
const mac = hex(64, 64);
const room = z.string().refine(isRoomId, 'must be a canonical decimal u64 room id').transform((r) => r as RoomId);
const reason = z.string().max(MAX_REASON_CHARS);
const count = z.number().int().min(0).max(Number.MAX_SAFE_INTEGER);
const settings = z.object({ fingerprint: hex(1, 128), contextSize: count, batchSize: count, flashAttention: z.boolean(), kvCacheType: z.string().regex(/^[a-z0-9_]{1,16}$/).optional(), protocol: z.string().max(32).optional(), build: z.string().max(80).optional() });

/** zod schema of every ControlMsg variant, discriminated on `type`. */
export const ControlMsgSchema = z.discriminatedUnion('type', [
  z.object({ type: z.literal('hello'), nonce, epoch, role: z.literal('prefill'), settings, streams: z.number().int().min(1).max(MAX_KV_STREAMS).optional() }),
  z.object({ type: z.literal('auth'), nonce, epoch, role: z.literal('decode'), mac, settings, streams: z.number().int().min(1).max(MAX_KV_STREAMS).optional(), stripe: z.object({ of: nonce, index: z.number().int().min(1).max(MAX_KV_STREAMS - 1) }).optional() }),
  z.object({ type: z.literal('auth_ok'), mac }),
  z.object({ type: z.literal('auth_fail'), reason, code: z.enum(['settings_mismatch', 'auth_failed']).optional() }),
  z.object({ type: z.literal('register'), room, rid: z.string().min(1).max(128), epoch, kvStream: z.boolean().optional() }),
  z.object({ type: z.literal('registered'), room }),
  z.object({ type: z.literal('kv_begin'), room, totalBytes: count, streamed: z.boolean().optional() }),
  z.object({ type: z.literal('kv_end'), room, totalBytes: count.optional(), crc: z.number().int().min(0).max(0xffffffff).optional() }),
  z.object({ type: z.literal('kv_ack'), room, epoch }),
  z.object({ type: z.literal('fail'), room, code: z.string().regex(/^[a-z_]{1,64}$/, 'must be an error code'), detail: reason, epoch }),
  z.object({ type: z.literal('same_host_probe'), boot: z.string().min(1).max(128), pidns: z.string().min(1).max(128), file: z.string().min(1).max(255) }),
  z.object({ type: z.literal('same_host_reply'), ok: z.boolean(), nonce: z.string().max(128).optional(), reason: reason.optional() }),
  z.object({ type: z.literal('same_host_ok'), verify: z.boolean().optional(), headerWalk: z.boolean().optional() }),
  z.object({ type: z.literal('kv_file'), room, file: z.string().min(1).max(255), payloadBytes: count, crc: z.number().int().min(0).max(0xffffffff).optional(), head: z.string().min(1).max(32 * 1024) }),
  z.object({ type: z.literal('kv_file_refused'), room, reason, epoch }),
  z.object({ type: z.literal('ping'), seq: count }),
  z.object({ type: z.literal('pong'), seq: count }),
]);

// Compile-time proof that the schemas and the ControlMsg union describe the same shapes.
type Same<A, B> = [A] extends [B] ? ([B] extends [A] ? true : false) : false;
const _schemaMatchesType: Same<z.infer<typeof ControlMsgSchema>, ControlMsg> = true;
void _schemaMatchesType;

const KNOWN_TYPES = new Set(ControlMsgSchema.options.map((o) => o.shape.type.value as string));

/**
 * Validates an already-parsed JSON value as a ControlMsg.
 * Throws KvError('BAD_FRAME') naming the first offending field.
 */
export function parseControl(value: unknown): ControlMsg {
  if (typeof value !== 'object' || value === null || Array.isArray(value)) {
    throw new KvError('BAD_FRAME', 'control message is not a JSON object');
  }
  const type = (value as { type?: unknown }).type;
  if (typeof type !== 'string' || !KNOWN_TYPES.has(type)) {
    throw new KvError('BAD_FRAME', `unknown control message type ${JSON.stringify(type)?.slice(0, 40) ?? 'undefined'}`);
  }
  const fast = checkHot(value as Record<string, unknown>);
  if (fast) return fast;
  const r = ControlMsgSchema.safeParse(value);
  if (!r.success) {
    const i = r.error.issues[0];
    throw new KvError('BAD_FRAME', `bad ${type} message: ${i ? `${i.path.join('.') || '(root)'}: ${i.message}` : 'invalid'}`);
  }
  return r.data as ControlMsg;
}

const EPOCH_RE = /^[0-9a-f]+$/;
const safeCount = (v: unknown): v is number => Number.isSafeInteger(v) && (v as number) >= 0;
const str = (v: unknown, min: number, max: number): v is string => typeof v === 'string' && v.length >= min && v.length <= max;

/**
 * The handoff's messages (`kv_begin`, `kv_end` and `kv_file`, and `kv_ack`, which every handoff
 * ends with) checked by hand, by exactly the rules of their ControlMsgSchema variants (unknown
 * keys stripped: the result is a new object of the known keys, in schema order). Returns
 * undefined when `v` is not such a message or breaks any rule: parseControl then runs the zod
 * schema, which refuses it with its usual wording (so nothing is accepted here that zod would
 * refuse, and every refusal still comes from zod; test/unit/frame.test.ts compares both on valid
 * and broken messages). Why: zod's safeParse in a process just woken up (cold caches) costs as
 * much as the loopback wake-up itself, once when prefill encodes the message and once when
 * decode reads it, on the handoff's critical path; kv_begin and kv_end likewise. This check is a
 * few field tests.
 * Exported for that test only.
 * @internal
 */
export function checkHot(v: Record<string, unknown>): ControlMsg | undefined {
  if (v.type === 'kv_begin') {
    const { room, totalBytes, streamed } = v;
    if (!isRoomId(room) || !safeCount(totalBytes)) return undefined;
    if (streamed !== undefined && typeof streamed !== 'boolean') return undefined;
    return streamed === undefined ? { type: 'kv_begin', room, totalBytes } : { type: 'kv_begin', room, totalBytes, streamed };
  }
  if (v.type === 'kv_end') {
    const { room, totalBytes, crc } = v;
    if (!isRoomId(room)) return undefined;
    if (totalBytes !== undefined && !safeCount(totalBytes)) return undefined;
    if (crc !== undefined && (!Number.isSafeInteger(crc) || (crc as number) < 0 || (crc as number) > 0xffffffff)) return undefined;
    const m: ControlMsg = { type: 'kv_end', room };
    if (totalBytes !== undefined) m.totalBytes = totalBytes;
    if (crc !== undefined) m.crc = crc as number;
    return m;
  }
  if (v.type === 'kv_file') {
    const { room, file, payloadBytes, crc, head } = v;
    if (!isRoomId(room) || !str(file, 1, 255) || !safeCount(payloadBytes) || !str(head, 1, 32 * 1024)) return undefined;
    if (crc === undefined) return { type: 'kv_file', room, file, payloadBytes, head };
    if (!Number.isSafeInteger(crc) || (crc as number) < 0 || (crc as number) > 0xffffffff) return undefined;
    return { type: 'kv_file', room, file, payloadBytes, crc: crc as number, head };
  }
  if (v.type === 'kv_ack') {
    const { room, epoch } = v;
    if (!isRoomId(room) || !str(epoch, 8, 64) || !EPOCH_RE.test(epoch)) return undefined;
    return { type: 'kv_ack', room, epoch };
  }
  return undefined;
}

// ---------------------------------------------------------------------------------------------
// Encoding

/**
 * Encodes one control frame. `fail` details / `auth_fail` reasons longer than MAX_REASON_CHARS are
 * truncated; anything else invalid (bad field, body over MAX_CONTROL_BYTES) throws
 * KvError('BAD_FRAME') — that is a bug at the caller.
 */
export function encodeControl(msg: ControlMsg): Buffer {
  let m: ControlMsg = msg;
  if (m.type === 'fail' && typeof m.detail === 'string' && m.detail.length > MAX_REASON_CHARS) {
    m = { ...m, detail: m.detail.slice(0, MAX_REASON_CHARS - 1) + '…' };
  } else if (m.type === 'auth_fail' && typeof m.reason === 'string' && m.reason.length > MAX_REASON_CHARS) {
    m = { ...m, reason: m.reason.slice(0, MAX_REASON_CHARS - 1) + '…' };
  }
  const valid = parseControl(m);
  const json = Buffer.from(JSON.stringify(valid), 'utf8');
  if (json.length > MAX_CONTROL_BYTES) {
    throw new KvError('BAD_FRAME', `control message of ${json.length} bytes exceeds MAX_CONTROL_BYTES (${MAX_CONTROL_BYTES})`);
  }
  const out = Buffer.allocUnsafe(FRAME_HEADER_BYTES + json.length);
  out.writeUInt32BE(json.length + 1, 0);
  out[4] = FRAME_CONTROL;
  json.copy(out, FRAME_HEADER_BYTES);
  return out;
}

/**
 * Encodes one KV chunk frame as [header (21 bytes: length, type, room, offset), data]. `data` is
 * not copied: it must stay unchanged until written. `roomId` must be canonical (see
 * normalizeRoomId), `offset` a safe non-negative integer (byte offset of `data` in the blob),
 * `data` 1..MAX_CHUNK_BYTES bytes; otherwise throws KvError('BAD_FRAME').
 */
export function encodeChunk(roomId: string, offset: number, data: Buffer): Buffer[] {
  if (!isRoomId(roomId)) throw new KvError('BAD_FRAME', `room id ${JSON.stringify(String(roomId)).slice(0, 40)} is not a canonical decimal u64`);
  if (!Number.isSafeInteger(offset) || offset < 0) throw new KvError('BAD_FRAME', `chunk offset ${offset} is not a safe non-negative integer`);
  if (data.length === 0) throw new KvError('BAD_FRAME', 'empty chunk');
  if (data.length > MAX_CHUNK_BYTES) throw new KvError('BAD_FRAME', `chunk of ${data.length} bytes exceeds MAX_CHUNK_BYTES (${MAX_CHUNK_BYTES})`);
  const h = Buffer.allocUnsafe(FRAME_HEADER_BYTES + CHUNK_PREFIX_BYTES);
  h.writeUInt32BE(1 + CHUNK_PREFIX_BYTES + data.length, 0);
  h[4] = FRAME_CHUNK;
  h.writeBigUInt64BE(BigInt(roomId), 5);
  h.writeBigUInt64BE(BigInt(offset), 13);
  return [h, data];
}

// ---------------------------------------------------------------------------------------------
// Decoding

/**
 * One decoded frame. `data` of a chunk may share memory with the buffers fed in. In streaming
 * mode a chunk frame comes out as one or more pieces in order (contiguous offsets); `final`
 * marks the piece that ends the frame (always true otherwise).
 */
export type Frame =
  | { kind: 'control'; msg: ControlMsg }
  | { kind: 'chunk'; room: RoomId; offset: number; data: Buffer; final: boolean };

const utf8 = new TextDecoder('utf-8', { fatal: true });

/**
 * Incremental frame decoder: feed it socket buffers as they come, in order. A buffer fed in is
 * not kept after `feed` returns (what a partial frame needs is copied), so the caller may reuse
 * it for the next read; frames yielded may be views of it, valid until then.
 *
 * State machine: `header` (needs 5 bytes; length and type are checked against the caps here) →
 * `body` (needs exactly length-1 bytes) → frame emitted → `header`. Holds at most one partial
 * frame. With `streamChunks`, a chunk frame goes `header` → `chunkPrefix` (16 bytes: room,
 * offset) → `chunkData`, which emits each received piece of data as soon as it arrives, without
 * copying or buffering it (zero-copy receive; the receiver places data by offset anyway).
 * After an error the decoder is poisoned: every later feed rethrows the same KvError.
 */
export class FrameDecoder {
  /** When false, a chunk frame header is an error (used before authentication). */
  acceptChunks: boolean;
  /** Emit chunk data in pieces as it arrives (see class doc). */
  readonly streamChunks: boolean;
  private readonly bufs: Buffer[] = [];
  private buffered = 0;
  private state: 'header' | 'body' | 'chunkPrefix' | 'chunkData' = 'header';
  private type = 0;
  private bodyLen = 0;
  private room = '' as RoomId;
  private offset = 0;
  private dataLeft = 0;
  private error: KvError | undefined;

  constructor(opts: { acceptChunks?: boolean; streamChunks?: boolean } = {}) {
    this.acceptChunks = opts.acceptChunks ?? true;
    this.streamChunks = opts.streamChunks ?? false;
  }

  /** Bytes held for the frame in progress. */
  get bufferedBytes(): number {
    return this.buffered;
  }

  /**
   * Consumes `chunk` and yields every frame it completes, in order. Throws KvError('BAD_FRAME')
   * at the first malformed frame (frames before it have already been yielded).
   */
  *feed(chunk: Buffer): Generator<Frame, void, undefined> {
    if (this.error) throw this.error;
    if (chunk.length > 0) {
      this.bufs.push(chunk);
      this.buffered += chunk.length;
    }
    try {
      for (;;) {
        switch (this.state) {
          case 'header': {
            if (this.buffered < FRAME_HEADER_BYTES) return;
            const h = this.take(FRAME_HEADER_BYTES);
            this.checkHeader(h.readUInt32BE(0), h[4]);
            this.state = this.type === FRAME_CHUNK && this.streamChunks ? 'chunkPrefix' : 'body';
            break;
          }
          case 'body': {
            if (this.buffered < this.bodyLen) return;
            const body = this.take(this.bodyLen);
            this.state = 'header';
            yield this.type === FRAME_CONTROL ? decodeControlBody(body) : decodeChunkBody(body);
            break;
          }
          case 'chunkPrefix': {
            if (this.buffered < CHUNK_PREFIX_BYTES) return;
            const p = this.take(CHUNK_PREFIX_BYTES);
            this.dataLeft = this.bodyLen - CHUNK_PREFIX_BYTES;
            this.room = p.readBigUInt64BE(0).toString() as RoomId;
            this.offset = chunkOffset(p.readBigUInt64BE(8), this.dataLeft);
            this.state = 'chunkData';
            break;
          }
          case 'chunkData': {
            if (this.buffered === 0) return;
            const n = Math.min(this.bufs[0].length, this.dataLeft);
            const data = this.take(n); // within the first buffer: a view, no copy
            const offset = this.offset;
            this.offset += n;
            this.dataLeft -= n;
            const final = this.dataLeft === 0;
            if (final) this.state = 'header';
            yield { kind: 'chunk', room: this.room, offset, data, final };
            break;
          }
        }
      }
    } catch (e) {
      this.error = e instanceof KvError ? e : new KvError('BAD_FRAME', `decoder failure: ${(e as Error)?.message ?? String(e)}`);
      this.bufs.length = 0;
      this.buffered = 0;
      throw this.error;
    } finally {
      // Bytes kept for the next feed must not be a view of `chunk`: the caller may reuse its
      // buffer for the next socket read (net.Socket `onread`). Only the last kept buffer can
      // be (earlier ones were copied by earlier feeds); it is at most one partial frame.
      const n = this.bufs.length;
      if (n > 0 && this.bufs[n - 1]!.buffer === chunk.buffer) this.bufs[n - 1] = Buffer.from(this.bufs[n - 1]!);
    }
  }

  private checkHeader(len: number, type: number): void {
    if (len === 0) throw new KvError('BAD_FRAME', 'zero-length frame');
    const body = len - 1;
    if (type === FRAME_CONTROL) {
      if (body === 0) throw new KvError('BAD_FRAME', 'empty control frame');
      if (body > MAX_CONTROL_BYTES) throw new KvError('BAD_FRAME', `control frame of ${body} bytes exceeds cap ${MAX_CONTROL_BYTES}`);
    } else if (type === FRAME_CHUNK) {
      if (!this.acceptChunks) throw new KvError('BAD_FRAME', 'chunk frame not allowed here (before authentication?)');
      if (body > MAX_CHUNK_BYTES + CHUNK_PREFIX_BYTES) {
        throw new KvError('BAD_FRAME', `chunk frame of ${body} bytes exceeds cap ${MAX_CHUNK_BYTES + CHUNK_PREFIX_BYTES}`);
      }
      if (body <= CHUNK_PREFIX_BYTES) throw new KvError('BAD_FRAME', `chunk frame of ${body} bytes carries no data`);
    } else {
      throw new KvError('BAD_FRAME', `unknown frame type ${type} (length ${len})`);
    }
    this.type = type;
    this.bodyLen = body;
  }

  /** Removes and returns exactly n buffered bytes (n <= buffered); copies only across buffers. */
  private take(n: number): Buffer {
    const first = this.bufs[0];
    if (first.length >= n) {
      if (first.length === n) this.bufs.shift();
      else this.bufs[0] = first.subarray(n);
      this.buffered -= n;
      return first.subarray(0, n);
    }
    const out = Buffer.allocUnsafe(n);
    let filled = 0;
    while (filled < n) {
      const b = this.bufs[0];
      const k = Math.min(b.length, n - filled);
      b.copy(out, filled, 0, k);
      filled += k;
      if (k === b.length) this.bufs.shift();
      else this.bufs[0] = b.subarray(k);
    }
    this.buffered -= n;
    return out;
  }
}

function decodeControlBody(body: Buffer): Frame {
  let text: string;
  try {
    text = utf8.decode(body);
  } catch {
    throw new KvError('BAD_FRAME', 'control frame is not valid UTF-8');
  }
  let value: unknown;
  try {
    value = JSON.parse(text);
  } catch (e) {
    throw new KvError('BAD_FRAME', `control frame is not valid JSON: ${(e as Error).message.slice(0, 100)}`);
  }
  return { kind: 'control', msg: parseControl(value) };
}

function chunkOffset(off: bigint, dataLen: number): number {
  if (off + BigInt(dataLen) > BigInt(Number.MAX_SAFE_INTEGER)) throw new KvError('BAD_FRAME', `chunk offset ${off} (+${dataLen}) is beyond 2^53-1`);
  return Number(off);
}

function decodeChunkBody(body: Buffer): Frame {
  const room = body.readBigUInt64BE(0).toString() as RoomId;
  const data = body.subarray(CHUNK_PREFIX_BYTES);
  return { kind: 'chunk', room, offset: chunkOffset(body.readBigUInt64BE(8), data.length), data, final: true };
}
