/** Run the real `pdserve` CLI (bin/pdserve.js, built dist/) as a child process, with a deadline. */
import { spawn } from 'node:child_process';
import { secureKit, secureTestMode } from './secure-mode.js';

/**
 * Run the real CLI (with `env` added to this process's environment); resolves with exit code and
 * output. In secure test mode (./secure-mode.ts) `doctor` gets the admin key and the
 * CA and client certificate, unless the test gives TLS flags of its own.
 */
export function cli(args: string[], timeoutMs = 20_000, env: Record<string, string> = {}): Promise<{ code: number | null; out: string; err: string; ms: number }> {
  if (secureTestMode() && args[0] === 'doctor' && !args.some((a) => a === '--ca' || a.startsWith('--internal-tls'))) {
    const k = secureKit();
    args = [...args, ...k.doctorArgs];
    env = { ...k.env, ...env };
  }
  return new Promise((resolve) => {
    const t0 = Date.now();
    const p = spawn(process.execPath, ['bin/pdserve.js', ...args], { stdio: ['ignore', 'pipe', 'pipe'], env: { ...process.env, ...env } });
    let out = '';
    let err = '';
    p.stdout.on('data', (d) => (out += d));
    p.stderr.on('data', (d) => (err += d));
    const t = setTimeout(() => p.kill('SIGKILL'), timeoutMs);
    p.on('close', (code) => {
      clearTimeout(t);
      resolve({ code, out, err, ms: Date.now() - t0 });
    });
  });
}

