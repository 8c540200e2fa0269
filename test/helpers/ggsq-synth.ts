/** A synthetic but structurally complete llama.cpp sequence state (ggsq v3), for store tests that need no model. */

/**
 * A ggsq v3 file of one sequence holding `tokens`, in a context of `nStream` sequences (the state
 * in stream `seq`), `nLayer` layers, `rowBytes` bytes per cell per K/V row (data filled with `fill`).
 */
export function synthState(tokens: readonly number[], o: { nStream?: number; seq?: number; nLayer?: number; rowBytes?: number; fill?: number } = {}): Buffer {
  const nStream = o.nStream ?? 1;
  const seq = o.seq ?? 0;
  const nLayer = o.nLayer ?? 2;
  const row = o.rowBytes ?? 8;
  const n = tokens.length;
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
    for (let p = 0; p < n; p++) {
      i32(p);
      u32(1);
      i32(seq);
    }
    u32(0); // v_trans
    u32(nLayer);
    for (let kv = 0; kv < 2; kv++) {
      for (let l = 0; l < nLayer; l++) {
        i32(1);
        const rs = Buffer.alloc(8);
        rs.writeBigUInt64LE(BigInt(row), 0);
        parts.push(rs);
        parts.push(Buffer.alloc(row * n, o.fill ?? 0x3c));
      }
    }
  }
  return Buffer.concat(parts);
}
