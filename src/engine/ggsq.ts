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
import { PdError } from '../base/errors.js';

export const GGSQ_MAGIC = 0x67677371;
export const GGSQ_VERSION = 3;
/** llama.cpp's LLAMA_MAX_SEQ: more streams than this cannot come from a real context. */
export const MAX_STREAMS = 256;
const MAX_LAYERS = 4096;
/** Largest accepted bytes per cell per layer (K or V row), 16 MiB. */
const MAX_ROW_BYTES = 1 << 24;
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

/**
 * What the ggsq walker asks its driver for next: `n` bytes to read (always bounded: at most
 * contextSize × 12), or `skip` bytes of KV data to pass over (a safe integer within the file's
 * limit: checked before it is asked for). `what` names the field for errors.
 */
export type GgsqNeed = { n: number; what: string } | { skip: number; what: string };

const LITTLE_ENDIAN_HOST = new Uint8Array(new Uint32Array([1]).buffer)[0] === 1;

/**
 * `b` as little-endian i32s without a copy when the host is little-endian and `b` is 4-byte
 * aligned (several times faster than Buffer#readInt32LE per field, which a long state's cell
 * metadata walk feels); undefined otherwise (use readInt32LE).
 */
function i32View(b: Buffer, count: number): Int32Array | undefined {
  return LITTLE_ENDIAN_HOST && b.byteOffset % 4 === 0 ? new Int32Array(b.buffer, b.byteOffset, count) : undefined;
}

/** The token ids of `tb` (n × i32), checked (≥ 0, < nVocab when given). */
function tokenIds(tb: Buffer, n: number, nVocab: number | undefined): number[] {
  const v = i32View(tb, n);
  const tokens = new Array<number>(n);
  for (let i = 0; i < n; i++) {
    const t = v ? v[i]! : tb.readInt32LE(i * 4);
    if (t < 0) bad(`token ${i} has negative id ${t}`);
    if (nVocab !== undefined && t >= nVocab) bad(`token ${i} id ${t} outside the vocabulary (${nVocab})`);
    tokens[i] = t;
  }
  return tokens;
}

/** The positions of stream `s`'s `cellCount` cells in `meta` (12 bytes each), checked: n_seq_id 1, seq_id and pos in range, no pos twice (`seenPos`, shared over streams). */
function cellPositions(meta: Buffer, cellCount: number, nTokens: number, seenPos: Uint8Array, s: number): number[] {
  const v = i32View(meta, cellCount * 3);
  const positions = new Array<number>(cellCount);
  for (let i = 0; i < cellCount; i++) {
    const p = v ? v[i * 3]! : meta.readInt32LE(i * 12);
    const nSeq = v ? v[i * 3 + 1]! >>> 0 : meta.readUInt32LE(i * 12 + 4);
    if (nSeq !== 1) bad(`stream ${s} cell ${i} has n_seq_id ${nSeq} (a sequence state has exactly 1)`);
    const seqId = v ? v[i * 3 + 2]! : meta.readInt32LE(i * 12 + 8);
    if (seqId < 0 || seqId >= MAX_STREAMS) bad(`stream ${s} cell ${i} seq_id ${seqId} out of range`);
    if (p < 0 || p >= nTokens) bad(`stream ${s} cell ${i} pos ${p} outside [0, n_tokens=${nTokens})`);
    if (seenPos[p]) bad(`stream ${s} cell ${i} repeats pos ${p}`);
    seenPos[p] = 1;
    positions[i] = p;
  }
  return positions;
}

/**
 * The ggsq v3 structure walk as a generator, so the same checks run over a whole buffer
 * (`parseStateFile`), over bytes as they stream in (`GgsqStreamParser`) and over positional
 * reads of the headers alone (`parseStateHeaders`). It yields what it needs next and receives
 * the bytes for reads (nothing for skips); it returns the parsed state.
 * Checks: see parseStateFile. Throws KvError('BAD_STATE') on any inconsistency it sees; the
 * driver reports truncation and trailing bytes.
 *
 * One generator, no nested ones, and sizes in Number arithmetic: this walk runs on the
 * handoff's critical path in a process that has just woken up (same-host take, TCP receive),
 * where every generator object and BigInt costs (a yield* per field made the header walk of an
 * 8-layer state ~2× slower). Sizes stay exact where they decide anything: a row is ≤ 2^24 and a
 * cell count < 2^32, so a product that is not exact is ≥ 2^53, above any byte limit.
 */
export function* walkStateFile(expect: StateExpect): Generator<GgsqNeed, ParsedState, Buffer | undefined> {
  if (!Number.isInteger(expect.contextSize) || expect.contextSize < 1) bad('expect.contextSize must be a positive integer');
  const max = expect.maxBytes;
  if (!Number.isSafeInteger(max) || max < 0) bad(`expect.maxBytes ${max} is not a byte count`);
  let pos = 0;
  /** The read of `n` bytes at `pos`, checked against the limit first. */
  const need = (n: number, what: string): GgsqNeed => {
    if (pos + n > max) bad(`truncated at byte ${pos}: ${what} needs ${n} bytes, ${max - pos} left`);
    return { n, what };
  };
  /** The skip over `row` × `cells` bytes of KV data (undefined: nothing to skip), checked against the limit first. */
  const skipOf = (row: number, cells: number, what: string): GgsqNeed | undefined => {
    const n = row * cells;
    if (pos + n > max || n > max) bad(`${what} of ${BigInt(row) * BigInt(cells)} bytes at byte ${pos} goes past the limit of ${max} bytes`);
    return n > 0 ? { skip: n, what } : undefined;
  };

  const magic = (yield need(4, 'magic'))!.readUInt32LE(0);
  pos += 4;
  if (magic !== GGSQ_MAGIC) bad(`magic 0x${magic.toString(16)} is not ggsq`);
  const version = (yield need(4, 'version'))!.readUInt32LE(0);
  pos += 4;
  if (version !== GGSQ_VERSION) bad(`version ${version}, expected ${GGSQ_VERSION}`);

  const nTokens = (yield need(4, 'n_tokens'))!.readUInt32LE(0);
  pos += 4;
  if (nTokens > expect.contextSize) bad(`n_tokens ${nTokens} exceeds the context size ${expect.contextSize}`);
  let tokens: number[] = [];
  if (nTokens > 0) {
    const tb = (yield need(nTokens * 4, 'token ids'))!;
    pos += nTokens * 4;
    tokens = tokenIds(tb, nTokens, expect.nVocab);
  }

  const nStreamOffset = pos;
  const nStream = (yield need(4, 'n_stream'))!.readUInt32LE(0);
  pos += 4;
  if (nStream < 1 || nStream > MAX_STREAMS) bad(`n_stream ${nStream} outside [1, ${MAX_STREAMS}]`);

  const streams: StateStream[] = [];
  let totalCells = 0;
  const seenPos = new Uint8Array(nTokens);
  for (let s = 0; s < nStream; s++) {
    const start = pos;
    const cellCount = (yield need(4, `stream ${s} cell_count`))!.readUInt32LE(0);
    pos += 4;
    if (cellCount > expect.contextSize) bad(`stream ${s} cell_count ${cellCount} exceeds the context size ${expect.contextSize}`);
    if (cellCount === 0) {
      streams.push({ start, end: pos, cellCount, positions: [] });
      continue;
    }
    totalCells += cellCount;
    if (totalCells > expect.contextSize) bad(`${totalCells} cells exceed the context size ${expect.contextSize}`);
    // n_seq_id must be 1, so each cell's metadata is exactly pos + n_seq_id + seq_id (12 bytes)
    const meta = (yield need(cellCount * 12, `stream ${s} cell metadata`))!;
    pos += cellCount * 12;
    const positions = cellPositions(meta, cellCount, nTokens, seenPos, s);
    const vTransRaw = (yield need(4, `stream ${s} v_trans`))!.readUInt32LE(0);
    pos += 4;
    if (vTransRaw > 1) bad(`stream ${s} v_trans ${vTransRaw} is not 0 or 1`);
    const nLayer = (yield need(4, `stream ${s} n_layer`))!.readUInt32LE(0);
    pos += 4;
    if (nLayer < 1 || nLayer > MAX_LAYERS) bad(`stream ${s} n_layer ${nLayer} out of range`);
    if (expect.nLayer !== undefined && nLayer !== expect.nLayer) bad(`stream ${s} n_layer ${nLayer}, this model has ${expect.nLayer}`);

    const k: StateLayerSection[] = [];
    for (let l = 0; l < nLayer; l++) {
      const h = (yield need(12, `K type and row_size (layer ${l})`))!;
      pos += 12;
      const type = h.readInt32LE(0);
      if (type < 0 || type >= MAX_GGML_TYPE) bad(`K type ${type} of layer ${l} out of range`);
      const row = h.readUInt32LE(4);
      if (h.readUInt32LE(8) !== 0 || row === 0 || row > MAX_ROW_BYTES) bad(`K row_size ${h.readBigUInt64LE(4)} of layer ${l} out of range`);
      const dataOffset = pos;
      const sk = skipOf(row, cellCount, `K data (layer ${l})`);
      if (sk) yield sk;
      pos += row * cellCount;
      k.push({ type, bytesPerCell: row, dataOffset });
    }
    const v: StateLayerSection[] = [];
    for (let l = 0; l < nLayer; l++) {
      const h = (yield need(12, vTransRaw === 0 ? `V type and row_size (layer ${l})` : `V type, el_size and n_embd_v_gqa (layer ${l})`))!;
      pos += 12;
      const type = h.readInt32LE(0);
      if (type < 0 || type >= MAX_GGML_TYPE) bad(`V type ${type} of layer ${l} out of range`);
      if (vTransRaw === 0) {
        const row = h.readUInt32LE(4);
        if (h.readUInt32LE(8) !== 0 || row === 0 || row > MAX_ROW_BYTES) bad(`V row_size ${h.readBigUInt64LE(4)} of layer ${l} out of range`);
        const dataOffset = pos;
        const sk = skipOf(row, cellCount, `V data (layer ${l})`);
        if (sk) yield sk;
        pos += row * cellCount;
        v.push({ type, bytesPerCell: row, dataOffset });
      } else {
        const elSize = h.readUInt32LE(4);
        if (elSize < 1 || elSize > 64) bad(`V el_size ${elSize} of layer ${l} out of range`);
        const nEmbd = h.readUInt32LE(8);
        if (nEmbd < 1 || nEmbd * elSize > MAX_ROW_BYTES) bad(`V n_embd_v_gqa ${nEmbd} of layer ${l} out of range`);
        const dataOffset = pos;
        const row = nEmbd * elSize;
        const sk = skipOf(row, cellCount, `V data (layer ${l})`);
        if (sk) yield sk;
        pos += row * cellCount;
        v.push({ type, bytesPerCell: row, elSize, nEmbd, dataOffset });
      }
    }
    streams.push({ start, end: pos, cellCount, positions, vTrans: vTransRaw === 1, nLayer, k, v });
  }

  if (totalCells !== nTokens) bad(`the KV holds ${totalCells} cells but the state lists ${nTokens} tokens`);
  return { version, nTokens, tokens, nStreamOffset, nStream, streams, totalCells, end: pos };
}

/**
 * Parse and validate a whole ggsq v3 sequence-state file.
 *
 * Checks (each before allocating or advancing): size ≤ maxBytes; magic and version;
 * n_tokens ≤ contextSize and fits; token ids ≥ 0 (and < nVocab when given); 1 ≤ n_stream ≤ 256
 * and fits; per stream cell_count ≤ contextSize and fits; per cell n_seq_id = 1, pos and
 * seq_id in range, positions a permutation of 0..n_tokens-1 (the sequence holds exactly its
 * tokens); v_trans ∈ {0,1}; n_layer = expect.nLayer; ggml types in range; row sizes in
 * (0, 16 MiB]; row_size × cell_count (exact) within the remaining bytes; total cells = n_tokens;
 * no trailing bytes.
 *
 * @param buf whole file contents.
 * @returns the decoded header, tokens and per-stream layout (offsets into `buf`).
 * @throws PdError('BAD_STATE', reason) on anything inconsistent, including truncation anywhere.
 */
export function parseStateFile(buf: Buffer, expect: StateExpect): ParsedState {
  if (!Buffer.isBuffer(buf)) bad('not a Buffer');
  if (buf.length > expect.maxBytes) bad(`${buf.length} bytes exceeds the limit of ${expect.maxBytes}`);
  const p = new GgsqStreamParser({ ...expect, maxBytes: buf.length });
  p.push(buf);
  return p.end();
}

/**
 * The ggsq walk over bytes as they arrive (decode validates a state while it streams in, before
 * llama.cpp sees a byte). `push` each piece in order; `end()` returns the parsed state once the
 * structure is complete. Reads are served straight from the pushed piece when it holds them,
 * else gathered in a small buffer (bounded by contextSize × 12 bytes); KV data is only counted.
 * @throws KvError('BAD_STATE') from `push` as soon as the bytes so far are inconsistent
 *   (including bytes after the end of the structure: trailing bytes) and from `end` when the
 *   structure is incomplete (truncation), or when more than `maxBytes` arrive.
 */
export class GgsqStreamParser {
  private readonly walk: Generator<GgsqNeed, ParsedState, Buffer | undefined>;
  private need: GgsqNeed | undefined;
  private result: ParsedState | undefined;
  private gather: Buffer | undefined;
  private gathered = 0;
  private skipLeft = 0;
  /** Bytes consumed so far. */
  pos = 0;

  constructor(private readonly expect: StateExpect) {
    this.walk = walkStateFile(expect);
    this.advance(undefined);
  }

  /** True once the whole structure has been seen. */
  get done(): boolean {
    return this.result !== undefined;
  }

  private advance(input: Buffer | undefined): void {
    const r = this.walk.next(input);
    if (r.done) {
      this.result = r.value;
      this.need = undefined;
      return;
    }
    this.need = r.value;
    if ('skip' in r.value) this.skipLeft = r.value.skip;
  }

  push(data: Buffer): void {
    if (this.pos + data.length > this.expect.maxBytes) bad(`${this.pos + data.length} bytes exceeds the limit of ${this.expect.maxBytes}`);
    let i = 0;
    while (i < data.length) {
      const need = this.need;
      if (!need) bad(`${data.length - i} trailing bytes after the state`);
      if ('skip' in need) {
        const n = Math.min(this.skipLeft, data.length - i);
        this.skipLeft -= n;
        i += n;
        this.pos += n;
        if (this.skipLeft === 0) this.advance(undefined);
        continue;
      }
      if (!this.gather && data.length - i >= need.n) {
        const piece = data.subarray(i, i + need.n);
        i += need.n;
        this.pos += need.n;
        this.advance(piece);
        continue;
      }
      this.gather ??= Buffer.allocUnsafe(need.n);
      const n = Math.min(need.n - this.gathered, data.length - i);
      data.copy(this.gather, this.gathered, i, i + n);
      this.gathered += n;
      i += n;
      this.pos += n;
      if (this.gathered === need.n) {
        const full = this.gather;
        this.gather = undefined;
        this.gathered = 0;
        this.advance(full);
      }
    }
  }

  /** The parsed state. @throws KvError('BAD_STATE') when the structure is not complete. */
  end(): ParsedState {
    if (this.result) return this.result;
    const need = this.need!;
    const want = 'skip' in need ? BigInt(this.skipLeft) : BigInt(need.n - this.gathered);
    bad(`truncated at byte ${this.pos}: ${need.what} needs ${want} more bytes`);
  }
}

/**
 * A state file read at positions (decode's taken same-host file): `size` bytes; `read(pos, n)`
 * returns exactly `n` bytes starting at byte `pos` (it is only asked within [0, size)), or throws.
 * The returned buffer need only stay valid until the next `read`.
 */
export interface PositionalSource {
  readonly size: number;
  read(pos: number, n: number): Buffer;
}

/**
 * The ggsq v3 structure walk of a whole file WITHOUT reading its KV data: the same
 * `walkStateFile` checks as `parseStateFile` (every count and size against the file's size),
 * but driven by positional reads of the headers — magic … token ids … cell metadata, then per
 * layer only the 12-byte type / row-size header — and seeking over each layer's data. What it
 * reads is independent of the KV size (n_tokens × 16 bytes + 24 bytes per layer and stream + a
 * few fields). It proves the file is a structurally complete state of exactly `src.size` bytes
 * (what llama.cpp needs in order not to abort); it says nothing about the data bytes.
 * @param expect as for parseStateFile; `maxBytes` (optional) bounds `src.size`.
 * @throws PdError('BAD_STATE') on any inconsistency, a file cut short of its structure, or
 *   bytes after the structure's end.
 */
export function parseStateHeaders(src: PositionalSource, expect: Omit<StateExpect, 'maxBytes'> & { maxBytes?: number }): ParsedState {
  if (!Number.isSafeInteger(src.size) || src.size < 0) bad(`file size ${src.size} is not a byte count`);
  if (expect.maxBytes !== undefined && src.size > expect.maxBytes) bad(`${src.size} bytes exceeds the limit of ${expect.maxBytes}`);
  const walk = walkStateFile({ ...expect, maxBytes: src.size });
  let pos = 0;
  let r = walk.next(undefined);
  while (!r.done) {
    const need = r.value;
    if ('skip' in need) {
      pos += Number(need.skip); // the walk checked it stays within src.size
      r = walk.next(undefined);
    } else {
      const b = src.read(pos, need.n);
      if (b.length !== need.n) bad(`truncated at byte ${pos}: ${need.what} needs ${need.n} bytes, ${b.length} read`);
      pos += need.n;
      r = walk.next(b);
    }
  }
  if (r.value.end !== src.size) bad(`${src.size - r.value.end} trailing bytes after the state`);
  return r.value;
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
  return Buffer.concat(reframedParts(buf, st, targetStreams));
}

/**
 * `rewriteNStream`'s output as pieces, without copying the KV data: a new head (up to and
 * including n_stream), views of `buf`'s non-empty streams, zero cell counts for the added empty
 * streams. Write them in order (writev) to get the re-framed file.
 * @param st `parseStateFile(buf, …)`'s result.
 * @throws PdError('BAD_STATE') when more than `targetStreams` streams are non-empty.
 */
export function reframedParts(buf: Buffer, st: ParsedState, targetStreams: number): Buffer[] {
  if (st.nStream === targetStreams) return [buf];
  const full = st.streams.filter((s) => s.cellCount > 0);
  if (full.length > targetStreams) bad(`${full.length} non-empty streams cannot fit ${targetStreams}`);
  const head = Buffer.from(buf.subarray(0, st.nStreamOffset + 4));
  head.writeUInt32LE(targetStreams, st.nStreamOffset);
  const parts: Buffer[] = [head];
  for (const s of full) parts.push(buf.subarray(s.start, s.end));
  const empties = targetStreams - full.length;
  if (empties > 0) parts.push(Buffer.alloc(4 * empties));
  return parts;
}

/**
 * How to re-frame a state file for a context with `targetStreams` sequences IN PLACE, without
 * copying its KV data: llama.cpp restores a single sequence's non-empty stream into the
 * destination sequence's own stream whatever its index, and skips empty streams
 * (llama-kv-cache.cpp `state_read`: `strm = seq_id == -1 ? s : seq_to_stream[seq_id]`, `continue`
 * on cell_count 0), so only the n_stream field must equal the loading context's. More streams:
 * write n_stream and grow the file by 4 zero bytes per added (empty) stream. Fewer: possible when
 * the streams to drop are all trailing and empty — write n_stream and cut the file there.
 * @returns the u32 to write at `nStreamOffset` and the file's new size, or undefined when only a
 *   copy can do it (`rewriteNStream`), or when nothing is to change.
 */
export function inPlaceReframe(st: ParsedState, targetStreams: number): { nStreamOffset: number; nStream: number; size: number } | undefined {
  if (!Number.isInteger(targetStreams) || targetStreams < 1 || targetStreams > MAX_STREAMS || targetStreams === st.nStream) return undefined;
  if (targetStreams > st.nStream) return { nStreamOffset: st.nStreamOffset, nStream: targetStreams, size: st.end + 4 * (targetStreams - st.nStream) };
  const dropped = st.streams.slice(targetStreams);
  if (dropped.some((x) => x.cellCount !== 0)) return undefined;
  return { nStreamOffset: st.nStreamOffset, nStream: targetStreams, size: st.streams[targetStreams]!.start };
}

/**
 * The state of the first `keep` tokens of a one-sequence state file: a new ggsq file holding
 * tokens[0, keep) and the cells of positions < keep (K rows, V rows or transposed V columns
 * copied), in the same stream layout. Lets the prefix store keep a prefix several sessions
 * share as an entry of its own (prefixes/prefix-store.ts) from one session's saved state —
 * llama.cpp saves whole sequences only.
 * @param st `parseStateFile(buf, …)`'s result.
 * @returns the pieces of the new file, in order (writev or Buffer.concat).
 * @throws PdError('BAD_STATE') when `keep` is not in [1, nTokens] or the state has more than one non-empty stream.
 */
export function truncatedStateParts(buf: Buffer, st: ParsedState, keep: number): Buffer[] {
  if (!Number.isInteger(keep) || keep < 1 || keep > st.nTokens) bad(`cannot keep ${keep} of ${st.nTokens} tokens`);
  const full = st.streams.filter((s) => s.cellCount > 0);
  if (full.length !== 1) bad(`${full.length} non-empty streams: only a one-sequence state can be cut`);
  const head = Buffer.alloc(12 + keep * 4 + 4);
  head.writeUInt32LE(GGSQ_MAGIC, 0);
  head.writeUInt32LE(st.version, 4);
  head.writeUInt32LE(keep, 8);
  buf.copy(head, 12, 12, 12 + keep * 4);
  head.writeUInt32LE(st.nStream, 12 + keep * 4);
  const parts: Buffer[] = [head];
  for (const s of st.streams) {
    if (s.cellCount === 0) {
      parts.push(Buffer.alloc(4));
      continue;
    }
    // runs of consecutive kept cells in file order: [first, end)
    const runs: [number, number][] = [];
    for (let i = 0; i < s.cellCount; i++) {
      if (s.positions[i]! >= keep) continue;
      const last = runs.at(-1);
      if (last && last[1] === i) last[1] = i + 1;
      else runs.push([i, i + 1]);
    }
    const count = Buffer.alloc(4);
    count.writeUInt32LE(keep, 0);
    parts.push(count);
    const meta = s.start + 4;
    for (const [a, b] of runs) parts.push(buf.subarray(meta + a * 12, meta + b * 12));
    const vt = meta + s.cellCount * 12;
    parts.push(buf.subarray(vt, vt + 8)); // v_trans, n_layer
    const rows = (sec: StateLayerSection): void => {
      parts.push(buf.subarray(sec.dataOffset - 12, sec.dataOffset));
      for (const [a, b] of runs) parts.push(buf.subarray(sec.dataOffset + a * sec.bytesPerCell, sec.dataOffset + b * sec.bytesPerCell));
    };
    for (const sec of s.k!) rows(sec);
    for (const sec of s.v!) {
      if (!s.vTrans) {
        rows(sec);
        continue;
      }
      // transposed: n_embd rows of cellCount elements each
      parts.push(buf.subarray(sec.dataOffset - 12, sec.dataOffset));
      const el = sec.elSize!;
      for (let j = 0; j < sec.nEmbd!; j++) {
        const row = sec.dataOffset + j * s.cellCount * el;
        for (const [a, b] of runs) parts.push(buf.subarray(row + a * el, row + b * el));
      }
    }
  }
  return parts;
}

/** Bytes of one stream per cell (K + V over all layers) — the KV cost of one token. */
export function kvBytesPerCell(stream: StateStream): number {
  let n = 0;
  for (const s of stream.k ?? []) n += s.bytesPerCell;
  for (const s of stream.v ?? []) n += s.bytesPerCell;
  return n;
}
