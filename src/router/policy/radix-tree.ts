/**
 * Approximate prefix tree of recent requests per tenant (one tenant = one worker), the data
 * structure of SGLang's cache-aware router (sgl-router's `tree.rs`): a radix tree over the
 * characters of the routing text; each node remembers which tenants sent a text through it and
 * when. It is built only from the router's own decisions, so it predicts — it does not know —
 * what a worker's KV cache holds: a hint, never a promise (workers re-check their real cache).
 *
 * Bounds: each tenant's share of the tree (the characters of the nodes it is on) is capped at
 * `maxCharsPerTenant`; beyond it the tenant's least recently used leaves are dropped
 * (SGLang trims per tenant on a timer; here it happens on insert, amortised by 10 % slack).
 * Every edge owns its characters (`ownedSlice`), so memory follows the characters counted.
 */

class Node {
  readonly children = new Map<string, Node>();
  /** Tenant → last access (monotonic ms). */
  readonly tenants = new Map<string, number>();
  constructor(
    public edge: string,
    public parent: Node | null,
  ) {}
}

/** Result of a prefix match. */
export interface PrefixMatch {
  /** Characters of the text matched by the tree (any tenant). */
  matchedChars: number;
  /** Tenant → characters of the text that tenant's recent requests share with it (absent = 0). */
  byTenant: Map<string, number>;
}

/**
 * A copy of `s[start, end)` that holds only its own characters. V8 makes `slice` of 13+
 * characters a view that keeps the whole parent string alive: an edge cut from a prompt would
 * keep the whole prompt, and the tree's memory would grow with the prompts routed, not with the
 * characters it counts (20 000 prompts sharing a 1.6 KB prefix: 46 MB of heap for 2 M characters
 * held). A UTF-16 round trip through a Buffer copies (lone surrogates included).
 */
export function ownedSlice(s: string, start: number, end = s.length): string {
  const part = s.slice(start, end);
  return part.length < 13 ? part : Buffer.from(part, 'utf16le').toString('utf16le');
}

const commonLen = (a: string, ai: number, b: string): number => {
  const n = Math.min(a.length - ai, b.length);
  let i = 0;
  while (i < n && a.charCodeAt(ai + i) === b.charCodeAt(i)) i++;
  return i;
};

export class PrefixTree {
  private readonly root = new Node('', null);
  private readonly size = new Map<string, number>();

  /** @param maxCharsPerTenant bound on each tenant's characters in the tree (≥ 1). */
  constructor(private readonly maxCharsPerTenant: number) {
    if (!(maxCharsPerTenant >= 1)) throw new RangeError('maxCharsPerTenant must be at least 1');
  }

  /** Characters of the tree attributed to `tenant`. */
  tenantChars(tenant: string): number {
    return this.size.get(tenant) ?? 0;
  }

  /** Record that `text` was routed to `tenant` at `now` (ms); evicts the tenant's LRU leaves beyond its bound. */
  insert(text: string, tenant: string, now: number): void {
    let node = this.root;
    node.tenants.set(tenant, now);
    let i = 0;
    while (i < text.length) {
      const child = node.children.get(text[i]!);
      if (!child) {
        const leaf = new Node(ownedSlice(text, i), node);
        node.children.set(text[i]!, leaf);
        this.touch(leaf, tenant, now);
        break;
      }
      const k = commonLen(text, i, child.edge);
      if (k < child.edge.length) this.split(child, k);
      const next = node.children.get(text[i]!)!;
      this.touch(next, tenant, now);
      node = next;
      i += k;
    }
    const sz = this.size.get(tenant) ?? 0;
    if (sz > this.maxCharsPerTenant * 1.1) this.evict(tenant, this.maxCharsPerTenant);
  }

  /** Longest prefix of `text` held in the tree, per tenant. Refreshes nothing (a read). */
  match(text: string): PrefixMatch {
    const byTenant = new Map<string, number>();
    let node = this.root;
    let i = 0;
    while (i < text.length) {
      const child = node.children.get(text[i]!);
      if (!child) break;
      const k = commonLen(text, i, child.edge);
      i += k;
      for (const t of child.tenants.keys()) byTenant.set(t, i);
      if (k < child.edge.length) break;
      node = child;
    }
    return { matchedChars: i, byTenant };
  }

  /** Drop everything of `tenant` (a removed worker). */
  removeTenant(tenant: string): void {
    this.evict(tenant, 0);
    this.root.tenants.delete(tenant);
    this.size.delete(tenant);
  }

  /** Drop `tenant`'s least recently used leaves until it holds at most `maxChars` characters. */
  evict(tenant: string, maxChars: number): void {
    let sz = this.size.get(tenant) ?? 0;
    if (sz <= maxChars) return;
    // Leaves of the tenant: nodes it is on with no child it is on.
    const leaves: Node[] = [];
    const walk = (n: Node): void => {
      let hasTenantChild = false;
      for (const c of n.children.values()) {
        if (c.tenants.has(tenant)) {
          hasTenantChild = true;
          walk(c);
        }
      }
      if (!hasTenantChild && n !== this.root && n.tenants.has(tenant)) leaves.push(n);
    };
    walk(this.root);
    const byAge = (a: Node, b: Node) => a.tenants.get(tenant)! - b.tenants.get(tenant)!;
    leaves.sort(byAge);
    while (sz > maxChars && leaves.length > 0) {
      const leaf = leaves.shift()!;
      leaf.tenants.delete(tenant);
      sz -= leaf.edge.length;
      const parent = leaf.parent!;
      if (leaf.tenants.size === 0 && leaf.children.size === 0) parent.children.delete(leaf.edge[0]!);
      if (parent !== this.root && parent.tenants.has(tenant) && ![...parent.children.values()].some((c) => c.tenants.has(tenant))) {
        // The parent became a leaf of the tenant: insert it in age order.
        const at = leaves.findIndex((l) => byAge(parent, l) < 0);
        leaves.splice(at === -1 ? leaves.length : at, 0, parent);
      }
    }
    this.size.set(tenant, sz);
  }

  private touch(n: Node, tenant: string, now: number): void {
    if (!n.tenants.has(tenant)) this.size.set(tenant, (this.size.get(tenant) ?? 0) + n.edge.length);
    n.tenants.set(tenant, now);
  }

  /** Split `n`'s edge after `k` characters: n keeps the head, a new child gets the tail. */
  private split(n: Node, k: number): void {
    const tail = new Node(ownedSlice(n.edge, k), n);
    for (const [t, at] of n.tenants) tail.tenants.set(t, at);
    for (const [ch, c] of n.children) {
      tail.children.set(ch, c);
      c.parent = tail;
    }
    n.children.clear();
    n.children.set(tail.edge[0]!, tail);
    n.edge = ownedSlice(n.edge, 0, k);
  }
}
