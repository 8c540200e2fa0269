/**
 * Decode's rules for receiving one room's KV state, sans-IO and shared by the decode worker and
 * the simulator (so the simulator checks the shipped rule, not a copy of it): the announced size
 * must be in (0, maxStateBytes]; the KV channel is one TCP connection (FIFO), so each chunk must
 * start exactly where the received bytes end and stay inside the announced size — a duplicated,
 * reordered or overflowing chunk fails the room; KV_END must come after exactly the announced
 * bytes. Byte storage stays with the caller (the worker copies into a buffer, the simulator
 * keeps tags).
 *
 * A state over decode's `--max-state-bytes` is not a transfer fault but a prompt too long for
 * this decode: it fails with `kv_state_too_large` (a 400, never retried: every attempt would
 * make the same state) and a message naming the size, the limit and the flag (`stateTooLarge`)
 * — announced (kv_begin, kv_file) or, streamed, as soon as the bytes in order pass the limit.
 */
import { failure, type RoomFailure } from '../base/errors.js';

/** A byte count for humans: "1058491 bytes (1.01 MiB)". */
function bytesText(n: number): string {
  const units: [number, string][] = [[1024 ** 3, 'GiB'], [1024 ** 2, 'MiB'], [1024, 'KiB']];
  const u = units.find(([d]) => n >= d);
  return u ? `${n} bytes (${Number((n / u[0]).toFixed(2))} ${u[1]})` : `${n} bytes`;
}

/**
 * The failure of a state over decode's limit (`kv_state_too_large`). `size`: the state's size in
 * bytes when known (announced by kv_begin or kv_file), or — streamed, where the size comes only
 * with kv_end — `{ over: true, estimate }`: more than `maxStateBytes` arrived, prefill estimated
 * `estimate` bytes (head + payload; omitted when not above the limit: it is a few hundred bytes off).
 */
export function stateTooLarge(maxStateBytes: number, size: number | { over: true; estimate?: number }): RoomFailure {
  const limit = `this decode worker's limit of ${bytesText(maxStateBytes)} (decode --max-state-bytes)`;
  if (typeof size === 'number') {
    return failure('kv_state_too_large', `the prompt's KV state of ${bytesText(size)} is over ${limit}: shorten the prompt, or start decode with --max-state-bytes of at least ${size}`);
  }
  const est = size.estimate !== undefined && size.estimate > maxStateBytes ? size.estimate : undefined;
  const needs = est !== undefined ? `about ${bytesText(est)} (prefill's estimate)` : `more than ${bytesText(maxStateBytes)}`;
  return failure('kv_state_too_large', `the prompt's KV state is over ${limit}: ${maxStateBytes} bytes arrived and more followed; it needs ${needs}: shorten the prompt, or start decode with a larger --max-state-bytes`);
}

/**
 * The failure for an announced state size outside (0, maxStateBytes], or undefined: over the
 * limit → `kv_state_too_large` (`stateTooLarge`); not positive → `kv_transfer_failed`.
 */
export function checkAnnounced(totalBytes: number, maxStateBytes: number): RoomFailure | undefined {
  if (totalBytes > 0 && totalBytes <= maxStateBytes) return undefined;
  if (totalBytes > maxStateBytes) return stateTooLarge(maxStateBytes, totalBytes);
  return failure('kv_transfer_failed', `announced state of ${totalBytes} bytes is outside (0, ${maxStateBytes}]`);
}

/**
 * Progress of one room's KV reception: `got` of `total` bytes, in order. `streamed` (a streamed
 * kv_begin: the size comes with kv_end): `total` is only the limit (decode's maxStateBytes),
 * `estimate` prefill's announced estimate, and `end` takes the count.
 */
export class KvReception {
  got = 0;

  constructor(
    readonly total: number,
    readonly streamed = false,
    readonly estimate?: number,
  ) {}

  /**
   * A chunk of `len` bytes at `offset`. Undefined when it is the next piece (the caller stores the
   * bytes; `got` has advanced); else the failure of the room: streamed, the next piece taking
   * the bytes past the limit → `kv_state_too_large`; out of place, or past an announced size →
   * `kv_transfer_failed`.
   */
  accept(offset: number, len: number): RoomFailure | undefined {
    if (this.streamed && offset === this.got && this.got + len > this.total) return stateTooLarge(this.total, { over: true, ...(this.estimate !== undefined ? { estimate: this.estimate } : {}) });
    if (offset !== this.got || this.got + len > this.total) {
      return failure('kv_transfer_failed', `chunk at offset ${offset} (+${len}) does not follow ${this.got} of ${this.total}`);
    }
    this.got += len;
    return undefined;
  }

  /**
   * KV_END arrived: undefined when every announced byte is in; else the failure of the room.
   * `sent`: the byte count a streamed kv_end carries (required when `streamed`, else ignored).
   */
  end(sent?: number): RoomFailure | undefined {
    if (this.streamed) {
      if (sent === undefined) return failure('kv_transfer_failed', 'streamed state: kv_end without its byte count');
      return this.got === sent ? undefined : failure('kv_transfer_failed', `truncated: kv_end says ${sent} bytes, ${this.got} received`);
    }
    return this.got === this.total ? undefined : failure('kv_transfer_failed', `truncated: kv_end after ${this.got} of ${this.total} bytes`);
  }
}
