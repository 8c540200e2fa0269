/**
 * Which build a process runs and which protocol it speaks, so a rolling upgrade's mixed cluster
 * says what it is made of (GET /health, GET /workers, the KV handshake, the router's /generate)
 * and refuses the pairs that cannot work.
 *
 * | name | value | compared |
 * |---|---|---|
 * | build | `<package version>+<git commit>` (`+source` when run from src/ without a build), written by scripts/build.mjs into `dist/build-info.json` | never: shown only |
 * | protocol | `MAJOR.MINOR` (PROTOCOL_VERSION) | same MAJOR = compatible |
 *
 * The protocol is everything the roles exchange: /generate bodies and events, the KV control
 * messages, the envelope and state-file layout, /health fields the router reads. A change an
 * older peer can ignore (a new optional field) bumps MINOR; one it would misread bumps MAJOR. A
 * process that does not report a protocol speaks 1.0 (the first that reported one).
 * `PDSERVE_TEST_PROTOCOL_VERSION` overrides this process's protocol: a test knob, never set in
 * production (it exists so a test can start a worker that speaks another major).
 */
import { readFileSync } from 'node:fs';

/** The protocol this build speaks, `MAJOR.MINOR`. */
export const PROTOCOL_VERSION = '1.2';

/** What a peer that reports no protocol speaks. */
export const IMPLIED_PROTOCOL = '1.0';

/** This build's identity: package version, commit, and the two joined (`0.1.0+1a2b3c4d5e6f`). */
export interface BuildInfo {
  version: string;
  commit: string;
  id: string;
}

function readJson(rel: string): Record<string, unknown> | undefined {
  try {
    return JSON.parse(readFileSync(new URL(rel, import.meta.url), 'utf8')) as Record<string, unknown>;
  } catch {
    return undefined;
  }
}

function loadBuild(): BuildInfo {
  // dist/base/version.js → dist/build-info.json (written by the build); from src/, none.
  const b = readJson('../build-info.json');
  const version = typeof b?.version === 'string' ? b.version : String(readJson('../../package.json')?.version ?? '0.0.0');
  const commit = typeof b?.commit === 'string' && b.commit ? b.commit : 'source';
  return { version, commit, id: `${version}+${commit}` };
}

/** This process's build (read once). */
export const BUILD: BuildInfo = loadBuild();

/** `MAJOR.MINOR` or undefined when `v` is not one. */
function parse(v: unknown): { major: number; minor: number } | undefined {
  if (typeof v !== 'string') return undefined;
  const m = /^(\d{1,6})\.(\d{1,6})$/.exec(v);
  return m ? { major: Number(m[1]), minor: Number(m[2]) } : undefined;
}

/** This process's protocol: PROTOCOL_VERSION, or the test override when it is a valid `MAJOR.MINOR`. */
export function protocolVersion(): string {
  const o = process.env.PDSERVE_TEST_PROTOCOL_VERSION;
  return o && parse(o) ? o : PROTOCOL_VERSION;
}

/** A protocol from a peer's message: its `MAJOR.MINOR`, IMPLIED_PROTOCOL when absent, the raw text (cut) when malformed. */
export function peerProtocol(v: unknown): string {
  if (v === undefined || v === null) return IMPLIED_PROTOCOL;
  return typeof v === 'string' ? v.slice(0, 32) : JSON.stringify(v).slice(0, 32);
}

/**
 * Why protocols `a` (ours) and `b` (the peer's) cannot work together — "protocol 2.0 ≠ 1.0
 * (another major)" — or undefined when they share a major. A malformed one never matches.
 */
export function protocolMismatch(a: string, b: string): string | undefined {
  const x = parse(a);
  const y = parse(b);
  if (x && y && x.major === y.major) return undefined;
  return `protocol ${a} ≠ ${b} (${x && y ? 'another major' : 'not MAJOR.MINOR'})`;
}
