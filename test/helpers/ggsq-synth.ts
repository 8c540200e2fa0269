/** A synthetic but structurally complete llama.cpp sequence state (ggsq v3), for store tests that need no model. */

/** Options of `synthState`. */
export interface SynthOptions {
  /** Sequences in the context (default 1); the state is in stream `seq` (default 0). */
  nStream?: number;
  seq?: number;
  /** Layers (default 2). */
  nLayer?: number;
  /** Bytes per cell per K row and per non-transposed V row (default 8). */
  rowBytes?: number;
  /** Every data byte, when `data` is not given (default 0x3c). */
  fill?: number;
  /** The cells' positions in file order (default 0, 1, …: in order); one per token. */
  positions?: readonly number[];
  /** Transposed V (v_trans 1): `rows` rows (n_embd_v_gqa) of `elBytes`-byte elements, one per cell. */
  vTrans?: { elBytes: number; rows: number };
  /** The value of every byte of a cell's data: K or V, layer, the cell's position, the V row (transposed V; else 0). */
  data?: (part: 'k' | 'v', layer: number, pos: number, row: number) => number;
}

/**
 * A ggsq v3 file of one sequence holding `tokens`, in a context of `nStream` sequences (the state
 * in stream `seq`), `nLayer` layers, `rowBytes` bytes per cell per K/V row (data filled with `fill`,
 * or byte by byte as `data` says).
 */
export function synthState(tokens: readonly number[], o: SynthOptions = {}): Buffer {
  const nStream = o.nStream ?? 1;
  const seq = o.seq ?? 0;
  const nLayer = o.nLayer ?? 2;
  const row = o.rowBytes ?? 8;
  const n = tokens.length;
  const positions = o.positions ?? tokens.map((_, i) => i);
  const parts: Buffer[] = [];
  const u32 = (v: number) => {
    const b = Buffer.alloc(4);
    b.writeUInt32LE(v >>> 0, 0);
    parts.push(b);
  };
  const i32 = (v: number) => {
    const b = Buffer.alloc(4);
    b.writeInt32LE(v, 0);
    parts.push(b);
  };
  const u64 = (v: number) => {
    const b = Buffer.alloc(8);
    b.writeBigUInt64LE(BigInt(v), 0);
    parts.push(b);
  };
  /** One row of `bytes` bytes per cell, in file order. */
  const cells = (part: 'k' | 'v', layer: number, bytes: number, vRow = 0) => {
    if (!o.data) parts.push(Buffer.alloc(bytes * n, o.fill ?? 0x3c));
    else for (const p of positions) parts.push(Buffer.alloc(bytes, o.data(part, layer, p, vRow)));
  };
  u32(0x67677371);
  u32(3);
  u32(n);
  for (const t of tokens) i32(t);
  u32(nStream);
  for (let s = 0; s < nStream; s++) {
    if (s !== seq || n === 0) {
      u32(0);
      continue;
    }
    u32(n);
    for (const p of positions) {
      i32(p);
      u32(1);
      i32(seq);
    }
    u32(o.vTrans ? 1 : 0); // v_trans
    u32(nLayer);
    for (let l = 0; l < nLayer; l++) {
      i32(1);
      u64(row);
      cells('k', l, row);
    }
    for (let l = 0; l < nLayer; l++) {
      i32(1);
      if (!o.vTrans) {
        u64(row);
        cells('v', l, row);
      } else {
        u32(o.vTrans.elBytes);
        u32(o.vTrans.rows);
        for (let j = 0; j < o.vTrans.rows; j++) cells('v', l, o.vTrans.elBytes, j);
      }
    }
  }
  return Buffer.concat(parts);
}
