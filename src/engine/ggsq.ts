/**
 * Pure byte functions over llama.cpp's sequence-state file ("ggsq", version 3), as written by
 * `llama_state_seq_save_file` (node-llama-cpp `LlamaContextSequence.saveStateToFile`).
 *
 * llama.cpp trusts this file: a truncation inside the KV data aborts the process (GGML_ASSERT)
 * and a huge cell_count makes it allocate until killed. So nothing may reach `loadState` that
 * `parseStateFile` has not accepted. The parser walks the whole structure and checks every
 * count and size against the bytes that remain and against sane limits before advancing.
 *
 * Layout (all little-endian; verified against llama.cpp src/llama-context.cpp
 * state_seq_save_file and src/llama-kv-cache.cpp state_write/state_write_meta/state_write_data,
 * and against files written by node-llama-cpp 3.21.1):
 *
 *   u32 magic 0x67677371 ("qsgg" on disk) | u32 version = 3
 *   u32 n_tokens | n_tokens × i32 token
 *   u32 n_stream                                  (= sequences of the saving context)
 *   per stream:
 *     u32 cell_count                              (0 → nothing else for this stream)
 *     cell_count × { i32 pos | u32 n_seq_id (=1 for a sequence save) | n_seq_id × i32 seq_id }
 *     u32 v_trans | u32 n_layer
 *     K, per layer: i32 ggml_type | u64 row_size | cell_count × row_size bytes
 *     V, per layer, v_trans = 0: i32 ggml_type | u64 row_size | cell_count × row_size bytes
 *     V, per layer, v_trans = 1: i32 ggml_type | u32 el_size | u32 n_embd_v_gqa |
 *                                n_embd_v_gqa × cell_count × el_size bytes
 *
 * Not supported (rejected as BAD_STATE): models whose cells carry the extra "ext" record (M-RoPE,
 * PLE) or whose layers lack a V tensor; neither occurs for the llama architecture.
 */
import { PdError } from '../common/errors.js';

export const GGSQ_MAGIC = 0x67677371;
export const GGSQ_VERSION = 3;
/** llama.cpp's LLAMA_MAX_SEQ: more streams than this cannot come from a real context. */
export const MAX_STREAMS = 256;
const MAX_LAYERS = 4096;
/** Largest accepted bytes per cell per layer (K or V row), 16 MiB. */
const MAX_ROW_BYTES = 1n << 24n;
/** ggml_type ids are small non-negative integers (GGML_TYPE_COUNT is < 64). */
const MAX_GGML_TYPE = 64;

/** What the loading side knows; the file must agree. */
export interface StateExpect {
  /** KV layers of the loading model; checked when given. */
  nLayer?: number;
  /** Tokens per sequence of the loading context: bounds n_tokens and every cell_count. */
  contextSize: number;
  /** Largest accepted file, bytes. */
  maxBytes: number;
  /** Vocabulary size; when given every token id must be below it. */
  nVocab?: number;
}

/** One K or V section of one layer. */
export interface StateLayerSection {
  /** ggml type id (1 = f16). */
  type: number;
  /** Bytes per cell (row size; for transposed V: el_size × n_embd_v_gqa). */
  bytesPerCell: number;
  /** Transposed V only: element size and row count. */
  elSize?: number;
  nEmbd?: number;
  /** Byte offset of the section's data in the file. */
  dataOffset: number;
}

/** One KV stream (one per sequence of the saving context). */
export interface StateStream {
  /** Byte offset of the stream's u32 cell_count; the stream's bytes are [start, end). */
  start: number;
  end: number;
  cellCount: number;
  /** Cell positions in file order (empty when cellCount = 0). */
  positions: number[];
  /** Only for non-empty streams. */
  vTrans?: boolean;
  nLayer?: number;
  k?: StateLayerSection[];
  v?: StateLayerSection[];
}

export interface ParsedState {
  version: number;
  nTokens: number;
  tokens: number[];
  /** Byte offset of the u32 n_stream field. */
  nStreamOffset: number;
  nStream: number;
  streams: StateStream[];
  /** Sum of cell_count over streams (equals nTokens: checked). */
  totalCells: number;
  /** End of the structure; equals the buffer length (trailing bytes are rejected). */
  end: number;
}

function bad(reason: string): never {
  throw new PdError('BAD_STATE', `bad sequence state: ${reason}`);
}

/** Bounds-checked little-endian reader; every read checks the remaining bytes first. */
class Reader {
  pos = 0;
  constructor(private readonly buf: Buffer) {}
  get remaining(): number {
    return this.buf.length - this.pos;
  }
  need(n: number | bigint, what: string): void {
    if (BigInt(n) > BigInt(this.remaining)) bad(`truncated at byte ${this.pos}: ${what} needs ${n} bytes, ${this.remaining} left`);
  }
  u32(what: string): number {
    this.need(4, what);
    const v = this.buf.readUInt32LE(this.pos);
    this.pos += 4;
    return v;
  }
  i32(what: string): number {
    this.need(4, what);
    const v = this.buf.readInt32LE(this.pos);
    this.pos += 4;
    return v;
  }
  u64(what: string): bigint {
    this.need(8, what);
    const v = this.buf.readBigUInt64LE(this.pos);
    this.pos += 8;
    return v;
  }
  skip(n: bigint, what: string): void {
    this.need(n, what);
    this.pos += Number(n);
  }
}

/**
 * Parse and validate a whole ggsq v3 sequence-state file.
 *
 * Checks (each before allocating or advancing): size ≤ maxBytes; magic and version;
 * n_tokens ≤ contextSize and fits; token ids ≥ 0 (and < nVocab when given); 1 ≤ n_stream ≤ 256
 * and fits; per stream cell_count ≤ contextSize and fits; per cell n_seq_id = 1, pos and
 * seq_id in range, positions a permutation of 0..n_tokens-1 (the sequence holds exactly its
 * tokens); v_trans ∈ {0,1}; n_layer = expect.nLayer; ggml types in range; row sizes in
 * (0, 16 MiB]; row_size × cell_count (BigInt) within the remaining bytes; total cells = n_tokens;
 * no trailing bytes.
 *
 * @param buf whole file contents.
 * @returns the decoded header, tokens and per-stream layout (offsets into `buf`).
 * @throws PdError('BAD_STATE', reason) on anything inconsistent, including truncation anywhere.
 */
export function parseStateFile(buf: Buffer, expect: StateExpect): ParsedState {
  if (!Buffer.isBuffer(buf)) bad('not a Buffer');
  if (!Number.isInteger(expect.contextSize) || expect.contextSize < 1) bad('expect.contextSize must be a positive integer');
  if (buf.length > expect.maxBytes) bad(`${buf.length} bytes exceeds the limit of ${expect.maxBytes}`);
  const r = new Reader(buf);

  const magic = r.u32('magic');
  if (magic !== GGSQ_MAGIC) bad(`magic 0x${magic.toString(16)} is not ggsq`);
  const version = r.u32('version');
  if (version !== GGSQ_VERSION) bad(`version ${version}, expected ${GGSQ_VERSION}`);

  const nTokens = r.u32('n_tokens');
  if (nTokens > expect.contextSize) bad(`n_tokens ${nTokens} exceeds the context size ${expect.contextSize}`);
  r.need(nTokens * 4, 'token ids');
  const tokens = new Array<number>(nTokens);
  for (let i = 0; i < nTokens; i++) {
    const t = r.i32('token');
    if (t < 0) bad(`token ${i} has negative id ${t}`);
    if (expect.nVocab !== undefined && t >= expect.nVocab) bad(`token ${i} id ${t} outside the vocabulary (${expect.nVocab})`);
    tokens[i] = t;
  }

  const nStreamOffset = r.pos;
  const nStream = r.u32('n_stream');
  if (nStream < 1 || nStream > MAX_STREAMS) bad(`n_stream ${nStream} outside [1, ${MAX_STREAMS}]`);
  r.need(nStream * 4, 'stream cell counts');

  const streams: StateStream[] = [];
  let totalCells = 0;
  const seenPos = new Uint8Array(nTokens);
  for (let s = 0; s < nStream; s++) {
    const start = r.pos;
    const cellCount = r.u32(`stream ${s} cell_count`);
    if (cellCount > expect.contextSize) bad(`stream ${s} cell_count ${cellCount} exceeds the context size ${expect.contextSize}`);
    if (cellCount === 0) {
      streams.push({ start, end: r.pos, cellCount, positions: [] });
      continue;
    }
    totalCells += cellCount;
    if (totalCells > expect.contextSize) bad(`${totalCells} cells exceed the context size ${expect.contextSize}`);
    // minimum meta per cell: pos + n_seq_id + one seq_id
    r.need(cellCount * 12, `stream ${s} cell metadata`);
    const positions = new Array<number>(cellCount);
    for (let i = 0; i < cellCount; i++) {
      const pos = r.i32('cell pos');
      const nSeq = r.u32('cell n_seq_id');
      if (nSeq !== 1) bad(`stream ${s} cell ${i} has n_seq_id ${nSeq} (a sequence state has exactly 1)`);
      const seqId = r.i32('cell seq_id');
      if (seqId < 0 || seqId >= MAX_STREAMS) bad(`stream ${s} cell ${i} seq_id ${seqId} out of range`);
      if (pos < 0 || pos >= nTokens) bad(`stream ${s} cell ${i} pos ${pos} outside [0, n_tokens=${nTokens})`);
      if (seenPos[pos]) bad(`stream ${s} cell ${i} repeats pos ${pos}`);
      seenPos[pos] = 1;
      positions[i] = pos;
    }
    const vTransRaw = r.u32(`stream ${s} v_trans`);
    if (vTransRaw > 1) bad(`stream ${s} v_trans ${vTransRaw} is not 0 or 1`);
    const nLayer = r.u32(`stream ${s} n_layer`);
    if (nLayer < 1 || nLayer > MAX_LAYERS) bad(`stream ${s} n_layer ${nLayer} out of range`);
    if (expect.nLayer !== undefined && nLayer !== expect.nLayer) bad(`stream ${s} n_layer ${nLayer}, this model has ${expect.nLayer}`);
    const cells = BigInt(cellCount);

    const k: StateLayerSection[] = [];
    for (let l = 0; l < nLayer; l++) {
      const type = r.i32(`K type (layer ${l})`);
      if (type < 0 || type >= MAX_GGML_TYPE) bad(`K type ${type} of layer ${l} out of range`);
      const row = r.u64(`K row_size (layer ${l})`);
      if (row === 0n || row > MAX_ROW_BYTES) bad(`K row_size ${row} of layer ${l} out of range`);
      const dataOffset = r.pos;
      r.skip(row * cells, `K data (layer ${l})`);
      k.push({ type, bytesPerCell: Number(row), dataOffset });
    }
    const v: StateLayerSection[] = [];
    for (let l = 0; l < nLayer; l++) {
      const type = r.i32(`V type (layer ${l})`);
      if (type < 0 || type >= MAX_GGML_TYPE) bad(`V type ${type} of layer ${l} out of range`);
      if (vTransRaw === 0) {
        const row = r.u64(`V row_size (layer ${l})`);
        if (row === 0n || row > MAX_ROW_BYTES) bad(`V row_size ${row} of layer ${l} out of range`);
        const dataOffset = r.pos;
        r.skip(row * cells, `V data (layer ${l})`);
        v.push({ type, bytesPerCell: Number(row), dataOffset });
      } else {
        const elSize = r.u32(`V el_size (layer ${l})`);
        if (elSize < 1 || elSize > 64) bad(`V el_size ${elSize} of layer ${l} out of range`);
        const nEmbd = r.u32(`V n_embd_v_gqa (layer ${l})`);
        if (nEmbd < 1 || BigInt(nEmbd) * BigInt(elSize) > MAX_ROW_BYTES) bad(`V n_embd_v_gqa ${nEmbd} of layer ${l} out of range`);
        const dataOffset = r.pos;
        r.skip(BigInt(nEmbd) * BigInt(elSize) * cells, `V data (layer ${l})`);
        v.push({ type, bytesPerCell: nEmbd * elSize, elSize, nEmbd, dataOffset });
      }
    }
    streams.push({ start, end: r.pos, cellCount, positions, vTrans: vTransRaw === 1, nLayer, k, v });
  }

  if (totalCells !== nTokens) bad(`the KV holds ${totalCells} cells but the state lists ${nTokens} tokens`);
  if (r.remaining !== 0) bad(`${r.remaining} trailing bytes after the state`);
  return { version, nTokens, tokens, nStreamOffset, nStream, streams, totalCells, end: r.pos };
}

/**
 * Re-frame a state for a context with `targetStreams` sequences: llama.cpp refuses a state whose
 * n_stream differs from the loading context's ("n_stream mismatch"), but it restores a non-empty
 * stream into the destination sequence's own stream whatever its index, so empty streams
 * (u32 cell_count = 0) can be added or dropped. Non-empty streams are kept in order, first.
 *
 * @param buf a file accepted by `parseStateFile` (it is parsed again here, with `expect`
 *   defaulting to limits derived from the buffer itself).
 * @returns a new Buffer (or `buf` itself when n_stream already equals targetStreams).
 * @throws PdError('BAD_STATE') when the file is malformed or has more non-empty streams than
 *   `targetStreams`; RangeError when targetStreams is outside [1, 256].
 */
export function rewriteNStream(buf: Buffer, targetStreams: number, expect?: StateExpect): Buffer {
  if (!Number.isInteger(targetStreams) || targetStreams < 1 || targetStreams > MAX_STREAMS) {
    throw new RangeError(`targetStreams must be an integer in [1, ${MAX_STREAMS}]`);
  }
  const st = parseStateFile(buf, expect ?? { contextSize: 0x7fffffff, maxBytes: buf.length });
  if (st.nStream === targetStreams) return buf;
  const full = st.streams.filter((s) => s.cellCount > 0);
  if (full.length > targetStreams) bad(`${full.length} non-empty streams cannot fit ${targetStreams}`);
  const head = Buffer.from(buf.subarray(0, st.nStreamOffset + 4));
  head.writeUInt32LE(targetStreams, st.nStreamOffset);
  const parts: Buffer[] = [head];
  for (const s of full) parts.push(buf.subarray(s.start, s.end));
  const empties = targetStreams - full.length;
  if (empties > 0) parts.push(Buffer.alloc(4 * empties));
  return Buffer.concat(parts);
}

/** Bytes of one stream per cell (K + V over all layers) — the KV cost of one token. */
export function kvBytesPerCell(stream: StateStream): number {
  let n = 0;
  for (const s of stream.k ?? []) n += s.bytesPerCell;
  for (const s of stream.v ?? []) n += s.bytesPerCell;
  return n;
}
