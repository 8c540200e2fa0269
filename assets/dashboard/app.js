// pdserve dashboard: polls /dashboard/data every 2 s and draws the time series with uPlot.
/* global uPlot */
'use strict';
(function () {
  const POLL_MS = 2000;
  const $ = (id) => document.getElementById(id);
  const charts = {};
  const text = (v) => (v === null || v === undefined ? '–' : String(v));
  const ms = (v) => (v >= 60000 ? `${(v / 60000).toFixed(1)} min` : v >= 1000 ? `${(v / 1000).toFixed(1)} s` : `${Math.round(v)} ms`);

  // Time axis: one-line 24-hour labels (HH:MM:SS, ~60 px) at least 90 px apart, so they never
  // overlap on a narrow chart; uPlot picks the tick step (5 s, 10 s, 15 s, 30 s, 1 min, …) to fit.
  const pad = (n) => String(n).padStart(2, '0');
  const timeLabel = (t) => {
    const d = new Date(t * 1000);
    return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
  };
  const timeAxis = { space: 90, values: (u, ticks) => ticks.map(timeLabel) };

  // A bucket without a sample (an idle 5 s: no request finished, so no TTFT or ITL) is null and
  // stays a gap in its line (spanGaps false): a line drawn across it would show latencies that
  // nobody measured. Points mark lone buckets between gaps.
  function chart(id, series, data) {
    const el = $(id);
    const width = Math.max(280, el.clientWidth || 360);
    if (!charts[id]) {
      charts[id] = new uPlot({ width, height: 180, series: [{}].concat(series.map((x) => Object.assign({ spanGaps: false, points: { show: true, size: 4 } }, x))), axes: [timeAxis, { size: 50 }], legend: { live: false } }, data, el);
    } else {
      charts[id].setData(data);
    }
  }

  function row(cells) {
    const tr = document.createElement('tr');
    for (const c of cells) {
      const td = document.createElement('td');
      if (c && typeof c === 'object') {
        td.textContent = c.text;
        if (c.cls) td.className = c.cls;
        if (c.title) td.title = c.title;
      } else td.textContent = text(c);
      tr.appendChild(td);
    }
    return tr;
  }

  function render(d) {
    const status = $('status');
    status.textContent = d.status;
    status.className = `badge ${d.status}`;
    $('updated').textContent = `updated ${new Date(d.at).toLocaleTimeString()} · gathered in ${d.gather_ms} ms`;
    $('inflight').textContent = text(d.router.inflight);
    const q = d.router.requests || {};
    $('requests').textContent = `${q.ok || 0} / ${q.client_error || 0} / ${q.error || 0} / ${q.timeout || 0}`;
    const kv = d.router.kv_events || {};
    $('kvevents').textContent = `${kv.consumed || 0} / ${kv.gaps || 0} · ${kv.held || 0}`;
    const ps = d.prefix_store;
    $('prefixstore').innerHTML = '';
    if (ps) {
      const mib = (b) => (b / 1048576).toFixed(1);
      for (const t of [
        `store ${mib(ps.store.bytes)} / ${mib(ps.store.budget_bytes)} MiB · ${ps.store.files} files`,
        `sequence hits ${ps.lookups.sequence.hit} / misses ${ps.lookups.sequence.miss}`,
        `store hits ${ps.lookups.store.hit} / misses ${ps.lookups.store.miss}`,
        `evictions ${ps.evictions}`,
        `events published ${ps.events.published} · consumed ${ps.events.consumed} · gaps ${ps.events.gaps}`,
      ]) {
        const c = document.createElement('span');
        c.textContent = t;
        $('prefixstore').appendChild(c);
      }
    }
    const phases = Object.entries(d.rooms_by_phase);
    $('phases').innerHTML = '';
    if (phases.length === 0) $('phases').textContent = 'none';
    for (const [k, v] of phases) {
      const s = document.createElement('span');
      s.textContent = `${k}: ${v}`;
      $('phases').appendChild(s);
    }
    const s = d.series;
    $('tps').textContent = s.tokens_per_s.length ? s.tokens_per_s[s.tokens_per_s.length - 1].toFixed(1) : '–';

    const fl = $('findings');
    fl.innerHTML = '';
    if (d.findings.length === 0) {
      const li = document.createElement('li');
      li.className = 'info';
      li.textContent = 'Nothing wrong found.';
      fl.appendChild(li);
    }
    for (const f of d.findings) {
      const li = document.createElement('li');
      li.className = f.severity;
      const b = document.createElement('b');
      b.textContent = `${f.severity.toUpperCase()}: ${f.title}`;
      const c = document.createElement('div');
      c.className = 'cause';
      c.textContent = `likely cause: ${f.cause}`;
      li.append(b, c);
      if (f.next) {
        const n = document.createElement('div');
        n.className = 'cause';
        const code = document.createElement('code');
        code.textContent = f.next;
        n.append('next: ', code);
        li.appendChild(n);
      }
      fl.appendChild(li);
    }

    const wb = document.querySelector('#workers tbody');
    wb.innerHTML = '';
    for (const w of d.workers) {
      const queues = Object.entries(w.queues).map(([k, v]) => `${k.replace(/^(prefill|decode)_/, '')}=${v}`).join(' ');
      const rooms = Object.entries(w.rooms_by_phase).map(([k, v]) => `${k}=${v}`).join(' ') || '–';
      const engine = w.gpu ? (w.gpu.gpu ? `${w.gpu.gpu} ${w.gpu.gpu_layers}` : 'cpu') : '–';
      wb.appendChild(row([w.role, w.url, { text: w.reachable ? w.state : `unreachable: ${w.last_error}`, cls: w.reachable ? w.state : 'unhealthy' }, { text: engine, title: w.gpu?.gpu_devices.join(', ') ?? '' }, w.load, w.slots === null ? '–' : `${w.slots_free}/${w.slots}`, queues || '–', rooms, w.oldest_room_ms ? ms(w.oldest_room_ms) : '–']));
    }
    const fb = document.querySelector('#failures tbody');
    fb.innerHTML = '';
    for (const f of s.failures) fb.appendChild(row(['router', f.code, f.count]));
    for (const f of d.room_failures) fb.appendChild(row([f.reason.split(':')[0], f.reason.split(': ')[1] || f.reason, f.count]));
    if (!fb.children.length) fb.appendChild(row(['–', 'no failures in the last 5 minutes', 0]));

    chart('chart-ttft', [{ label: 'p50', stroke: '#3b7dd8', width: 2 }, { label: 'p95', stroke: '#c0392b', width: 2 }], [s.t, s.ttft_p50_ms, s.ttft_p95_ms]);
    chart('chart-itl', [{ label: 'p50', stroke: '#3b7dd8', width: 2 }, { label: 'p95', stroke: '#c0392b', width: 2 }], [s.t, s.itl_p50_ms, s.itl_p95_ms]);
    chart('chart-tput', [{ label: 'tokens/s', stroke: '#1f8b4c', width: 2 }, { label: 'req/s', stroke: '#3b7dd8', width: 2 }, { label: 'failed/s', stroke: '#c0392b', width: 2 }, { label: 'client err/s', stroke: '#d68910', width: 2 }], [s.t, s.tokens_per_s, s.requests_per_s, s.failed_per_s, s.rejected_per_s || s.t.map(() => 0)]);
    document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
  }

  async function poll() {
    try {
      const r = await fetch('/dashboard/data', { cache: 'no-store' });
      if (!r.ok) throw new Error(`HTTP ${r.status}`);
      render(await r.json());
    } catch (err) {
      $('status').textContent = `router unreachable (${err.message})`;
      $('status').className = 'badge critical';
    } finally {
      setTimeout(poll, POLL_MS);
    }
  }
  poll();
})();
