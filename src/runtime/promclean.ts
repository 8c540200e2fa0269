/**
 * prom-client's default process metrics, renamed where they break the Prometheus naming rules.
 *
 * prom-client 15 exports three gauges whose names end in `_total`
 * (`nodejs_active_handles_total`, `nodejs_active_requests_total`, `nodejs_active_resources_total`);
 * `promtool check metrics` rejects them ("non-counter metrics should not have _total suffix"), and
 * so would any scraper that enforces the OpenMetrics conventions. `collectCleanDefaultMetrics`
 * registers the defaults, then drops every such gauge: where prom-client already exports the
 * same count split by type under the name without the suffix (`pdserve_nodejs_active_handles`
 * {type}), the `_total` one is only their sum; otherwise it is replaced by a gauge without the
 * suffix that reads the original at scrape time, labels included.
 */
import client, { type Registry } from 'prom-client';

/**
 * `collectDefaultMetrics({register, prefix})` followed by the rename above.
 * Returns the names that were dropped or renamed, old → new (for tests and docs).
 */
export function collectCleanDefaultMetrics(register: Registry, prefix = 'pdserve_'): Record<string, string> {
  client.collectDefaultMetrics({ register, prefix });
  const renamed: Record<string, string> = {};
  for (const m of register.getMetricsAsArray()) {
    const name = (m as unknown as { name: string }).name;
    const type = (m as unknown as { type?: string }).type;
    if (!name.endsWith('_total') || type !== 'gauge') continue;
    const original = m as unknown as client.Gauge<string>;
    const help = (m as unknown as { help: string }).help;
    const labelNames = (m as unknown as { labelNames?: string[] }).labelNames ?? [];
    register.removeSingleMetric(name);
    const clean = name.slice(0, -'_total'.length);
    renamed[name] = clean;
    // prom-client also exports the same count split by type under the clean name: the sum is redundant.
    if (register.getSingleMetric(clean)) continue;
    new client.Gauge({
      name: clean,
      help,
      labelNames,
      registers: [register],
      async collect() {
        const v = await original.get();
        this.reset();
        for (const s of v.values) this.set(s.labels as Record<string, string | number>, s.value);
      },
    });
  }
  return renamed;
}
