/**
 * The model file a role is given, checked before any worker starts: llama.cpp reading a
 * missing file, a directory or another format dies deep in native code with a stack trace in a
 * log; this says what is wrong in one line. A check of the header only (4 bytes), not of the
 * whole file: a damaged GGUF is still llama.cpp's to refuse.
 */
import { closeSync, openSync, readSync, statSync } from 'node:fs';
import { PdError } from '../base/errors.js';

/** The first bytes of every GGUF file (its magic, "GGUF"). */
const GGUF_MAGIC = Buffer.from('GGUF', 'latin1');

/**
 * Check that `path` names a readable GGUF file.
 * @param path absolute or relative file path
 * @throws PdError('bad_model_file', one line naming the path and the problem) when the path does
 *   not exist, is a directory or another non-regular file, cannot be read, or does not start with
 *   the GGUF magic
 */
export function checkModelFile(path: string): void {
  const bad = (why: string): never => {
    throw new PdError('bad_model_file', `model ${path}: ${why}`);
  };
  let size = 0;
  try {
    const st = statSync(path);
    if (st.isDirectory()) bad('is a directory, not a GGUF file');
    if (!st.isFile()) bad('is not a regular file');
    size = st.size;
  } catch (err) {
    if (err instanceof PdError) throw err;
    const e = err as NodeJS.ErrnoException;
    bad(e.code === 'ENOENT' ? 'no such file' : `cannot be read (${e.code ?? e.message})`);
  }
  const head = Buffer.alloc(GGUF_MAGIC.length);
  let fd: number | undefined;
  try {
    fd = openSync(path, 'r');
    readSync(fd, head, 0, head.length, 0);
  } catch (err) {
    const e = err as NodeJS.ErrnoException;
    bad(`cannot be read (${e.code ?? e.message})`);
  } finally {
    if (fd !== undefined) closeSync(fd);
  }
  if (size < GGUF_MAGIC.length || !head.equals(GGUF_MAGIC)) bad('is not a GGUF file (it does not start with "GGUF")');
}
