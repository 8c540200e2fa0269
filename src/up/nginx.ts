/**
 * A throwaway nginx as the load balancer in front of several routers: Debian's `nginx` (package
 * nginx-light or nginx) with the config docs/OPERATIONS.md documents ("Several routers"), on a
 * free loopback port; its config, temp folders and logs in a temp folder removed on stop. Used by
 * `pdserve bench-routers` and the membership end-to-end test.
 */
import { spawn, spawnSync } from 'node:child_process';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { ConfigError, PdError } from '../base/errors.js';
import { freePort } from './cluster.js';

/** The nginx binary (/usr/sbin/nginx, /usr/bin/nginx or on PATH), or null when it is not installed. */
export function nginxBinary(): string | null {
  for (const p of ['/usr/sbin/nginx', '/usr/bin/nginx']) if (spawnSync('test', ['-x', p]).status === 0) return p;
  const r = spawnSync('sh', ['-c', 'command -v nginx'], { encoding: 'utf8' });
  return r.status === 0 && r.stdout.trim() ? r.stdout.trim() : null;
}

/** The upstream and server blocks of OPERATIONS.md's config for `routers` (`host:port` each), listening on `listen` (`host:port`). */
export function nginxSite(routers: string[], listen: string): string {
  return `upstream pdserve_routers {
${routers.map((r) => `    server ${r} max_fails=1 fail_timeout=10s;`).join('\n')}
    keepalive 32;
}
server {
    listen ${listen};
    location / {
        proxy_pass http://pdserve_routers;
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_set_header Host $host;
        proxy_buffering off;
        proxy_request_buffering off;
        proxy_read_timeout 310s;
        proxy_next_upstream error timeout http_502 http_503;
        proxy_next_upstream_tries 2;
    }
}
`;
}

/** A running nginx: its base URL (`http://127.0.0.1:PORT`). */
export interface LocalNginx {
  url: string;
  /** SIGQUIT (SIGKILL after 3 s) and remove its folder. Idempotent. */
  stop(): Promise<void>;
}

/**
 * Start nginx in front of `routers` (`http://host:port` each) and wait until it answers GET
 * /health (deadline 10 s).
 * @throws ConfigError when nginx is not installed; PdError START_FAILED when it does not come up.
 */
export async function startNginx(routers: string[]): Promise<LocalNginx> {
  const bin = nginxBinary();
  if (!bin) throw new ConfigError('nginx is not installed (apt-get install nginx-light)');
  const dir = mkdtempSync(join(tmpdir(), 'pdserve-nginx-'));
  const port = await freePort();
  const conf = join(dir, 'nginx.conf');
  writeFileSync(
    conf,
    `daemon off;
worker_processes 1;
pid ${dir}/nginx.pid;
error_log ${dir}/error.log warn;
events { worker_connections 256; }
http {
    access_log off;
    client_body_temp_path ${dir}/body;
    proxy_temp_path ${dir}/proxy;
    fastcgi_temp_path ${dir}/fastcgi;
    uwsgi_temp_path ${dir}/uwsgi;
    scgi_temp_path ${dir}/scgi;
${nginxSite(routers.map((u) => new URL(u).host), `127.0.0.1:${port}`)
  .split('\n')
  .map((l) => (l ? `    ${l}` : l))
  .join('\n')}
}
`,
  );
  const child = spawn(bin, ['-c', conf, '-p', dir], { stdio: 'ignore' });
  const stop = async () => {
    if (child.exitCode === null && child.signalCode === null) {
      const exited = new Promise((r) => child.once('exit', r));
      child.kill('SIGQUIT');
      const t = setTimeout(() => child.kill('SIGKILL'), 3000);
      await exited;
      clearTimeout(t);
    }
    rmSync(dir, { recursive: true, force: true });
  };
  const url = `http://127.0.0.1:${port}`;
  const end = Date.now() + 10_000;
  for (;;) {
    try {
      const r = await fetch(`${url}/health`, { signal: AbortSignal.timeout(500) });
      if (r.status < 500) break;
    } catch {
      // not up yet
    }
    if (child.exitCode !== null || Date.now() > end) {
      await stop();
      throw new PdError('START_FAILED', `nginx did not come up on ${url}`);
    }
    await new Promise((r) => setTimeout(r, 100));
  }
  return { url, stop };
}
