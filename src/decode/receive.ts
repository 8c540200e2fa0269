/**
 * Decode's rules for receiving one room's KV state, sans-IO and shared by the decode worker and
 * the simulator (so the simulator checks the shipped rule, not a copy of it): the announced size
 * must be in (0, maxStateBytes]; the KV channel is one TCP connection (FIFO), so each chunk must
 * start exactly where the received bytes end and stay inside the announced size — a duplicated,
 * reordered or overflowing chunk fails the room; KV_END must come after exactly the announced
 * bytes. Byte storage stays with the caller (the worker copies into a buffer, the simulator
 * keeps tags).
 */
import { failure, type RoomFailure } from '../base/errors.js';

/** The failure for an announced state size outside (0, maxStateBytes], or undefined. */
export function checkAnnounced(totalBytes: number, maxStateBytes: number): RoomFailure | undefined {
  if (totalBytes > 0 && totalBytes <= maxStateBytes) return undefined;
  return failure('kv_transfer_failed', `announced state of ${totalBytes} bytes is outside (0, ${maxStateBytes}]`);
}

/**
 * Progress of one room's KV reception: `got` of `total` bytes, in order. `streamed` (a streamed
 * kv_begin: the size comes with kv_end): `total` is only the limit, and `end` takes the count.
 */
export class KvReception {
  got = 0;

  constructor(
    readonly total: number,
    readonly streamed = false,
  ) {}

  /**
   * A chunk of `len` bytes at `offset`. Undefined when it is the next piece (the caller stores the
   * bytes; `got` has advanced); else the failure of the room.
   */
  accept(offset: number, len: number): RoomFailure | undefined {
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
