/**
 * Prompt text for the storm's agents: real prose from the corpus shipped in `corpus/` (see
 * corpus/README.md for sources) plus the project's own docs, folded to ASCII (so a prompt's
 * byte count bounds its token count on a byte-fallback vocabulary) and cut into paragraphs.
 */
import { existsSync, readdirSync, readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import type { Prng } from '../base/prng.js';
import { ConfigError } from '../base/errors.js';

const here = dirname(fileURLToPath(import.meta.url));
/** Repository root, from src/harness or dist/harness. */
export const ROOT = join(here, '..', '..');

const FOLD: Record<string, string> = {
  '\u2018': "'", '\u2019': "'", '\u201a': "'", '\u201b': "'", '\u2032': "'",
  '\u201c': '"', '\u201d': '"', '\u201e': '"', '\u2033': '"',
  '\u2010': '-', '\u2011': '-', '\u2012': '-', '\u2013': '-', '\u2014': ' - ', '\u2015': ' - ', '\u2212': '-',
  '\u2026': '...', '\u2192': '->', '\u2190': '<-', '\u2194': '<->', '\u21d2': '=>', '\u25b6': '>', '\u25c0': '<',
  '\u2265': '>=', '\u2264': '<=', '\u2260': '!=', '\u00d7': 'x', '\u00b7': '*', '\u2022': '*', '\u00a0': ' ', '\u2248': '~',
  '\u2502': '|', '\u2500': '-', '\u250c': '+', '\u2510': '+', '\u2514': '+', '\u2518': '+', '\u251c': '+', '\u2524': '+', '\u252c': '+', '\u2534': '+', '\u253c': '+',
};

/** Fold typographic punctuation to ASCII, strip accents, drop anything else outside printable ASCII. */
export function foldAscii(s: string): string {
  let out = '';
  for (const ch of s.normalize('NFKD')) {
    const c = ch.codePointAt(0)!;
    if (c === 10 || (c >= 32 && c < 127)) out += ch;
    else if (c === 9) out += ' ';
    else if (FOLD[ch] !== undefined) out += FOLD[ch];
    // combining marks (accents after NFKD) and everything else: dropped
  }
  return out;
}

/** Paragraphs of a text: blank-line separated, whitespace-collapsed, short ones merged forward. */
export function paragraphs(text: string, minChars = 120): string[] {
  const raw = text
    .split(/\n\s*\n/)
    .map((p) => p.replace(/\s+/g, ' ').trim())
    .filter((p) => p.length > 0);
  const out: string[] = [];
  let acc = '';
  for (const p of raw) {
    acc = acc ? `${acc} ${p}` : p;
    if (acc.length >= minChars) {
      out.push(acc);
      acc = '';
    }
  }
  if (acc) out.push(acc);
  return out;
}

/** The loaded corpus: paragraphs from every source, in a fixed order (file name order). */
export class Corpus {
  readonly paras: string[];
  readonly sources: { name: string; bytes: number }[];

  constructor(texts: { name: string; text: string }[]) {
    this.sources = [];
    this.paras = [];
    for (const t of texts) {
      const folded = foldAscii(t.text);
      this.sources.push({ name: t.name, bytes: folded.length });
      this.paras.push(...paragraphs(folded));
    }
    if (this.paras.length === 0) throw new ConfigError('the storm corpus is empty');
  }

  /** Total characters. */
  get size(): number {
    return this.sources.reduce((a, s) => a + s.bytes, 0);
  }

  /**
   * A passage of `minChars`..`maxChars` characters starting at a random paragraph: following
   * paragraphs are joined until long enough, then cut at a word boundary.
   */
  passage(rng: Prng, minChars: number, maxChars: number): string {
    const target = rng.int(Math.max(1, minChars), Math.max(minChars, maxChars));
    let i = rng.int(0, this.paras.length - 1);
    let s = this.paras[i]!;
    while (s.length < target) {
      i = (i + 1) % this.paras.length;
      s += `\n\n${this.paras[i]}`;
    }
    if (s.length > target) {
      const cut = s.lastIndexOf(' ', target);
      s = s.slice(0, cut > target / 2 ? cut : target);
    }
    return s.trim();
  }
}

/**
 * Load `corpus/*.txt` and the project's docs (README.md, docs/*.md) from the repository root.
 * @throws Error when no text is found.
 */
export function loadCorpus(root = ROOT): Corpus {
  const texts: { name: string; text: string }[] = [];
  const add = (dir: string, ext: string, prefix: string) => {
    if (!existsSync(dir)) return;
    for (const f of readdirSync(dir).filter((x) => x.endsWith(ext)).sort()) {
      if (f === 'README.md' && prefix === 'corpus/') continue;
      texts.push({ name: `${prefix}${f}`, text: readFileSync(join(dir, f), 'utf8') });
    }
  };
  add(join(root, 'corpus'), '.txt', 'corpus/');
  add(join(root, 'docs'), '.md', 'docs/');
  if (existsSync(join(root, 'README.md'))) texts.push({ name: 'README.md', text: readFileSync(join(root, 'README.md'), 'utf8') });
  return new Corpus(texts);
}
