/**
 * A small multi-host lab on one Linux machine (root only): one network namespace per host, each
 * with its own address on a private /24, joined by veth pairs to a bridge in the test's own
 * namespace (which gets .254, so the test reaches every host). Traffic only ever goes to these
 * addresses. `cut(host)` / `restore(host)` take a host's link down and up; `blackhole(host, ip)`
 * drops one destination inside a host. `down()` (also run on process exit) deletes everything.
 */
import { execFileSync } from 'node:child_process';

const ip = (...args: string[]) => execFileSync('ip', args, { stdio: ['ignore', 'ignore', 'pipe'] });

/** Why namespaces cannot be used here, or null when they can. */
export function netnsUnavailable(): string | null {
  if (process.platform !== 'linux') return `not Linux (${process.platform})`;
  if (process.getuid?.() !== 0) return 'not root (ip netns needs CAP_SYS_ADMIN)';
  const probe = `pdt-probe-${process.pid}`;
  try {
    ip('netns', 'add', probe);
    ip('netns', 'del', probe);
    return null;
  } catch (err) {
    return `ip netns does not work: ${String((err as { stderr?: Buffer }).stderr ?? err).trim()}`;
  }
}

export class NetLab {
  readonly subnet: string;
  readonly addr: Record<string, string> = {};
  readonly ns: Record<string, string> = {};
  private readonly hostSide: Record<string, string> = {};
  private readonly bridge: string;
  private readonly tag: string;
  private done = false;
  private readonly onExit = () => this.down();

  constructor(hosts: string[]) {
    this.tag = (process.pid % 46656).toString(36).padStart(3, '0');
    // 10.231.N.0/24 with N from the pid; refuse one that a route already covers.
    const n = 1 + (process.pid % 250);
    this.subnet = `10.231.${n}`;
    const routes = execFileSync('ip', ['-4', 'route'], { encoding: 'utf8' });
    if (routes.includes(`${this.subnet}.`)) throw new Error(`subnet ${this.subnet}.0/24 is already routed here`);
    this.bridge = `pdb${this.tag}`;
    hosts.forEach((h, i) => {
      this.addr[h] = `${this.subnet}.${i + 1}`;
      this.ns[h] = `pdt-${this.tag}-${h}`;
      this.hostSide[h] = `pdv${this.tag}${i}`;
    });
    process.once('exit', this.onExit);
  }

  /** Create the bridge, the namespaces and their links. */
  up(): void {
    ip('link', 'add', this.bridge, 'type', 'bridge');
    ip('addr', 'add', `${this.subnet}.254/24`, 'dev', this.bridge);
    ip('link', 'set', this.bridge, 'up');
    Object.keys(this.addr).forEach((h, i) => {
      const ns = this.ns[h]!;
      const inner = `pdc${this.tag}${i}`;
      ip('netns', 'add', ns);
      ip('link', 'add', this.hostSide[h]!, 'type', 'veth', 'peer', 'name', inner);
      ip('link', 'set', inner, 'netns', ns);
      ip('-n', ns, 'addr', 'add', `${this.addr[h]}/24`, 'dev', inner);
      ip('-n', ns, 'link', 'set', inner, 'up');
      ip('-n', ns, 'link', 'set', 'lo', 'up');
      ip('link', 'set', this.hostSide[h]!, 'master', this.bridge);
      ip('link', 'set', this.hostSide[h]!, 'up');
    });
  }

  /** Take `host`'s link down (everything to and from it is lost). */
  cut(host: string): void {
    ip('link', 'set', this.hostSide[host]!, 'down');
  }

  restore(host: string): void {
    ip('link', 'set', this.hostSide[host]!, 'up');
  }

  /** Inside `host`, drop every packet to `dest` (or stop doing so with `on = false`). */
  blackhole(host: string, dest: string, on = true): void {
    ip('-n', this.ns[host]!, 'route', on ? 'add' : 'del', 'blackhole', `${dest}/32`);
  }

  /** Delete namespaces (their processes' sockets go with them) and the bridge. Idempotent. */
  down(): void {
    if (this.done) return;
    this.done = true;
    process.off('exit', this.onExit);
    for (const ns of Object.values(this.ns)) {
      try {
        ip('netns', 'del', ns);
      } catch {
        // already gone
      }
    }
    try {
      ip('link', 'del', this.bridge);
    } catch {
      // already gone
    }
  }
}
