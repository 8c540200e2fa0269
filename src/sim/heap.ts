/**
 * The simulator's event queue: a binary min-heap ordered by (time, insertion sequence), so two
 * events at the same virtual time run in the order they were scheduled — fully deterministic.
 */
export interface SimEvent {
  at: number;
  seq: number;
  run: () => void;
}

export class EventHeap {
  private readonly h: SimEvent[] = [];
  private seq = 0;

  get size(): number {
    return this.h.length;
  }

  push(at: number, run: () => void): void {
    const h = this.h;
    const e: SimEvent = { at, seq: this.seq++, run };
    let i = h.length;
    h.push(e);
    while (i > 0) {
      const p = (i - 1) >> 1;
      if (!less(e, h[p]!)) break;
      h[i] = h[p]!;
      i = p;
    }
    h[i] = e;
  }

  pop(): SimEvent | undefined {
    const h = this.h;
    const top = h[0];
    const last = h.pop();
    if (top === undefined || last === undefined || h.length === 0) return top;
    let i = 0;
    const n = h.length;
    for (;;) {
      const l = 2 * i + 1;
      if (l >= n) break;
      const r = l + 1;
      const c = r < n && less(h[r]!, h[l]!) ? r : l;
      if (!less(h[c]!, last)) break;
      h[i] = h[c]!;
      i = c;
    }
    h[i] = last;
    return top;
  }
}

const less = (x: SimEvent, y: SimEvent): boolean => x.at < y.at || (x.at === y.at && x.seq < y.seq);
