/**
 * Trace ids of a worker's rooms, for GET /debug/rooms. The room lifecycle core knows rooms by id
 * and rid only; the worker records each room's trace id here when its /generate arrives and
 * `tag` adds `trace` to every room row of a /debug/rooms body (live, recent, decoding). A worker
 * may also `note` a room's last facts (decode: `path`, `kv_path`, `cached_tokens`) when it lets
 * the room go, so its `recent` row still shows them after the request ended. Bounded: the oldest
 * of `max` entries is forgotten first (recent rooms then show `trace: null` and no noted facts).
 */
export class TraceTags {
  private readonly m = new Map<string, { trace: string | null; facts?: Record<string, unknown> }>();

  constructor(readonly max = 4096) {}

  /** Remember `trace` for `room` (the request's trace id, or its rid when the router sent none). */
  set(room: string, trace: string): void {
    this.put(room, { trace, facts: this.m.get(room)?.facts });
  }

  /** Remember extra fields of `room` for its /debug/rooms rows; a row's own fields win over them. */
  note(room: string, facts: Record<string, unknown>): void {
    this.put(room, { trace: this.get(room), facts });
  }

  get(room: string): string | null {
    return this.m.get(room)?.trace ?? null;
  }

  /** `body` with `trace` (and the noted facts) added to each row of its `live`, `recent` and `decoding` arrays. */
  tag<T extends Record<string, unknown>>(body: T): T {
    const out: Record<string, unknown> = { ...body };
    for (const k of ['live', 'recent', 'decoding']) {
      const rows = body[k];
      if (Array.isArray(rows)) out[k] = rows.map((r: { room: string }) => ({ ...this.m.get(r.room)?.facts, ...r, trace: this.get(r.room) }));
    }
    return out as T;
  }

  private put(room: string, v: { trace: string | null; facts?: Record<string, unknown> }): void {
    this.m.delete(room);
    this.m.set(room, v);
    if (this.m.size > this.max) this.m.delete(this.m.keys().next().value as string);
  }
}
