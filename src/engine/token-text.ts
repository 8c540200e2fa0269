/**
 * The text of single tokens as they appear in a generated text, for logprobs (OpenAI's
 * `tokens`, `top_logprobs`, chat `token`/`bytes`). A token detokenized alone loses what its
 * context gives it (SentencePiece drops the leading space of a text's first word), so every token
 * is rendered after the tokens before it, as the output text itself is. A token that holds part of
 * a multi-byte UTF-8 character has no text of its own: it is rendered as `bytes:\xNN…` (the
 * escape form of OpenAI's legacy completions) and carries its raw bytes, so the bytes of all
 * tokens always concatenate to the UTF-8 of the text.
 */
import type { LlamaModel, Token } from 'node-llama-cpp';

/** One token rendered in context: `bytes` present only when they are not the UTF-8 of `token`. */
export interface TokenText {
  token: string;
  bytes?: number[];
}

/** Tokens of context kept for rendering (node-llama-cpp's detokenizer looks back fewer). */
export const CONTEXT_TOKENS = 16;

const fatal = new TextDecoder('utf-8', { fatal: true, ignoreBOM: true });

/** Whether `bytes` are a complete, valid UTF-8 text on their own. */
export function isUtf8(bytes: readonly number[]): boolean {
  try {
    fatal.decode(Uint8Array.from(bytes));
    return true;
  } catch {
    return false;
  }
}

/** `bytes:\xe2\x80` — the rendering of a token that is not valid text on its own (lowercase hex). */
export function escapeBytes(bytes: readonly number[]): string {
  return 'bytes:' + bytes.map((b) => '\\x' + b.toString(16).padStart(2, '0')).join('');
}

let gpt2Bytes: Map<string, number> | undefined;

/**
 * GPT-2's byte-level BPE alphabet, inverted: the printable character that stands for each byte
 * (bytes_to_unicode of openai/gpt-2's encoder.py) → the byte.
 */
function gpt2ByteOf(): Map<string, number> {
  if (gpt2Bytes) return gpt2Bytes;
  const direct: number[] = [];
  for (let b = 0x21; b <= 0x7e; b++) direct.push(b);
  for (let b = 0xa1; b <= 0xac; b++) direct.push(b);
  for (let b = 0xae; b <= 0xff; b++) direct.push(b);
  const m = new Map<string, number>();
  for (const b of direct) m.set(String.fromCodePoint(b), b);
  const isDirect = new Set(direct);
  let n = 0;
  for (let b = 0; b < 256; b++) if (!isDirect.has(b)) m.set(String.fromCodePoint(256 + n++), b);
  return (gpt2Bytes = m);
}

/**
 * The raw bytes a vocabulary piece stands for, or undefined when the tokenizer kind is unknown
 * (or the piece is not of its alphabet).
 * @param piece the piece as stored in the GGUF (`tokenizer.ggml.tokens`).
 * @param kind `tokenizer.ggml.model`: 'llama' (SentencePiece: `<0xNN>` byte tokens, U+2581 for a
 *   space) or 'gpt2' (byte-level BPE); other kinds give undefined.
 */
export function pieceBytes(piece: string, kind: string | undefined): number[] | undefined {
  if (kind === 'llama') {
    const m = /^<0x([0-9A-Fa-f]{2})>$/.exec(piece);
    return m ? [parseInt(m[1]!, 16)] : [...Buffer.from(piece.replace(/\u2581/g, ' '), 'utf8')];
  }
  if (kind === 'gpt2') {
    const map = gpt2ByteOf();
    const out: number[] = [];
    for (const ch of piece) {
      const b = map.get(ch);
      if (b === undefined) return undefined;
      out.push(b);
    }
    return out;
  }
  return undefined;
}

/**
 * Render one token: a token whose raw bytes (`raw`, from its vocabulary piece) are not valid
 * UTF-8 on their own is part of a multi-byte character and becomes `bytes:\xNN…` with `bytes`
 * (its text in context would be U+FFFD, or '' after the character's first part); any other token
 * is its text in context (`inContext`). Without raw bytes (unknown tokenizer) the text is kept.
 */
export function renderToken(raw: number[] | undefined, inContext: () => string): TokenText {
  if (raw && !isUtf8(raw)) return { token: escapeBytes(raw), bytes: raw };
  return { token: inContext() };
}

/** The UTF-8 bytes of a rendered token: its raw bytes when it has them, else its text's. */
export function bytesOf(t: TokenText): number[] {
  return t.bytes ?? [...Buffer.from(t.token, 'utf8')];
}

/**
 * Renders tokens of one model in context (see the file's comment). Context is the tokens before
 * the rendered one — prompt included, so the first generated token gets the same leading space as
 * in the text; only the last CONTEXT_TOKENS are looked at.
 */
export class TokenRenderer {
  private readonly pieces: readonly unknown[];
  private readonly kind: string | undefined;

  constructor(private readonly model: LlamaModel) {
    const tk = (model.fileInfo.metadata as unknown as { tokenizer?: { ggml?: { tokens?: unknown[]; model?: unknown } } }).tokenizer?.ggml;
    this.pieces = tk?.tokens ?? [];
    this.kind = typeof tk?.model === 'string' ? tk.model : undefined;
  }

  /** `token` as it reads after `context` (token ids, oldest first). */
  render(token: number, context: readonly number[]): TokenText {
    const p = this.pieces[token];
    return renderToken(typeof p === 'string' ? pieceBytes(p, this.kind) : undefined, () => {
      const last = context.length > CONTEXT_TOKENS ? context.slice(-CONTEXT_TOKENS) : context;
      return this.model.detokenize([token as Token], false, last as Token[]);
    });
  }
}
