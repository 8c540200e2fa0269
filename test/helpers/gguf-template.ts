/**
 * A copy of a GGUF file with `tokenizer.chat_template` set: a trained model that ships without a
 * chat template (stories260K) gets one, so tests see the model's real text through a template's
 * tool-call syntax. GGUF v2/v3 layout (ggml's gguf.md): header, key/value pairs, tensor infos,
 * padding to `general.alignment` (32 by default), tensor data; tensor offsets are relative to
 * the data section, so the data is copied unchanged after the re-padded header.
 */
import { createHash } from 'node:crypto';
import { existsSync, readFileSync, renameSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

const KEY = 'tokenizer.chat_template';
const T_UINT32 = 4;
const T_STRING = 8;
const T_ARRAY = 9;
/** Byte size of the fixed-size GGUF value types, by type id. */
const SIZE: Record<number, number> = { 0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8 };

/**
 * Write (once, cached in the temp folder by content) `src` with its chat template replaced by
 * `template`; returns the new file's path.
 * @throws Error when `src` is not a GGUF v2/v3 file.
 */
export function withChatTemplate(src: string, template: string): string {
  const buf = readFileSync(src);
  const out = join(tmpdir(), `pdserve-tmpl-${createHash('sha256').update(buf).update(template).digest('hex').slice(0, 16)}.gguf`);
  if (existsSync(out)) return out;
  if (buf.toString('latin1', 0, 4) !== 'GGUF' || ![2, 3].includes(buf.readUInt32LE(4))) throw new Error(`${src}: not a GGUF v2/v3 file`);
  let p = 8;
  const nTensors = buf.readBigUInt64LE(p);
  const nKv = Number(buf.readBigUInt64LE(p + 8));
  p += 16;
  const str = (): string => {
    const n = Number(buf.readBigUInt64LE(p));
    const s = buf.toString('utf8', p + 8, p + 8 + n);
    p += 8 + n;
    return s;
  };
  const skip = (type: number): void => {
    if (type === T_STRING) str();
    else if (type === T_ARRAY) {
      const t = buf.readUInt32LE(p);
      const n = Number(buf.readBigUInt64LE(p + 4));
      p += 12;
      for (let i = 0; i < n; i++) skip(t);
    } else if (SIZE[type] !== undefined) p += SIZE[type]!;
    else throw new Error(`${src}: unknown GGUF value type ${type}`);
  };
  const kvs: Buffer[] = [];
  let alignment = 32;
  for (let i = 0; i < nKv; i++) {
    const start = p;
    const key = str();
    const type = buf.readUInt32LE(p);
    p += 4;
    if (key === 'general.alignment' && type === T_UINT32) alignment = buf.readUInt32LE(p);
    skip(type);
    if (key !== KEY) kvs.push(buf.subarray(start, p));
  }
  const infoStart = p;
  for (let i = 0n; i < nTensors; i++) {
    str();
    const nDims = buf.readUInt32LE(p);
    p += 4 + nDims * 8 + 4 + 8;
  }
  const infos = buf.subarray(infoStart, p);
  const dataStart = Math.ceil(p / alignment) * alignment;
  const u64 = (n: number | bigint) => {
    const b = Buffer.alloc(8);
    b.writeBigUInt64LE(BigInt(n));
    return b;
  };
  const u32 = (n: number) => {
    const b = Buffer.alloc(4);
    b.writeUInt32LE(n);
    return b;
  };
  const text = (s: string) => Buffer.concat([u64(Buffer.byteLength(s)), Buffer.from(s, 'utf8')]);
  const head = Buffer.concat([buf.subarray(0, 8), u64(nTensors), u64(kvs.length + 1), ...kvs, text(KEY), u32(T_STRING), text(template), infos]);
  const pad = Buffer.alloc(Math.ceil(head.length / alignment) * alignment - head.length);
  const tmp = `${out}.${process.pid}.tmp`;
  writeFileSync(tmp, Buffer.concat([head, pad, buf.subarray(dataStart)]));
  renameSync(tmp, out);
  return out;
}
