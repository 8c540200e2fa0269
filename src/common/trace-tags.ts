/**
 * Trace ids of a worker's rooms, for GET /debug/rooms. The room lifecycle core knows rooms by id
 * and rid only; the worker records each room's trace id here when its /generate arrives and
 * `tag` adds `trace` to every room row of a /debug/rooms body (live, recent, decoding). Bounded:
 * the oldest of `max` entries is forgotten first (recent rooms then show `trace: null`).
 */
export class TraceTags {
  private readonly m = new Map<string, string>();

  constructor(readonly max = 4096) {}

  /** Remember `trace` for `room` (the request's trace id, or its rid when the router sent none). */
  set(room: string, trace: string): void {
    this.m.delete(room);
    this.m.set(room, trace);
    if (this.m.size > this.max) this.m.delete(this.m.keys().next().value as string);
  }

  get(room: string): string | null {
    return this.m.get(room) ?? null;
  }

  /** `body` with `trace` added to each row of its `live`, `recent` and `decoding` arrays. */
  tag<T extends Record<string, unknown>>(body: T): T {
    const out: Record<string, unknown> = { ...body };
    for (const k of ['live', 'recent', 'decoding']) {
      const rows = body[k];
      if (Array.isArray(rows)) out[k] = rows.map((r: { room: string }) => ({ ...r, trace: this.get(r.room) }));
    }
    return out as T;
  }
}
