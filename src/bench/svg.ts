/**
 * Hand-written SVG charts for BENCHMARKS.md (no plotting package): grouped bar charts and
 * line/point charts with linear or log y axes. Output is small, self-contained SVG text.
 */

const COLORS = ['#1f77b4', '#d62728', '#2ca02c', '#ff7f0e', '#9467bd'];
const FONT = 'font-family="Helvetica, Arial, sans-serif"';

function esc(s: string): string {
  return s.replace(/&/g, '&amp;').replace(/</g, '&lt;').replace(/>/g, '&gt;').replace(/"/g, '&quot;');
}

/** "Nice" tick values covering [lo, hi] (about `count` of them). */
export function niceTicks(lo: number, hi: number, count = 5): number[] {
  if (!Number.isFinite(lo) || !Number.isFinite(hi)) return [0, 1];
  if (hi <= lo) hi = lo + 1;
  const raw = (hi - lo) / count;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw) ?? 10 * mag;
  const out: number[] = [];
  const end = Math.ceil(hi / step - 1e-9) * step;
  for (let v = Math.floor(lo / step) * step; v <= end + step * 1e-9; v += step) out.push(Number(v.toPrecision(12)));
  return out;
}

function label(v: number): string {
  if (v === 0) return '0';
  const a = Math.abs(v);
  if (a >= 1e6) return `${(v / 1e6).toPrecision(3).replace(/\.?0+$/, '')}M`;
  if (a >= 1e4) return `${(v / 1e3).toPrecision(3).replace(/\.?0+$/, '')}k`;
  if (a >= 100) return v.toFixed(0);
  if (a >= 1) return String(Number(v.toPrecision(3)));
  return String(Number(v.toPrecision(2)));
}

interface Frame {
  width: number;
  height: number;
  left: number;
  right: number;
  top: number;
  bottom: number;
}

function frame(width: number, height: number): Frame {
  return { width, height, left: 64, right: 24, top: 56, bottom: 48 };
}

function header(f: Frame, title: string): string[] {
  return [
    `<svg xmlns="http://www.w3.org/2000/svg" width="${f.width}" height="${f.height}" viewBox="0 0 ${f.width} ${f.height}" ${FONT} font-size="12">`,
    `<rect width="100%" height="100%" fill="white"/>`,
    `<text x="${f.width / 2}" y="20" text-anchor="middle" font-size="14" font-weight="bold">${esc(title)}</text>`,
  ];
}

function legend(f: Frame, names: string[]): string[] {
  const out: string[] = [];
  let x = f.left;
  const y = 30;
  names.forEach((n, i) => {
    out.push(`<rect x="${x}" y="${y}" width="10" height="10" fill="${COLORS[i % COLORS.length]}"/>`);
    out.push(`<text x="${x + 14}" y="${y + 9}">${esc(n)}</text>`);
    x += 30 + n.length * 7;
  });
  return out;
}

/** Options of `barChart`. */
export interface BarChartOptions {
  title: string;
  yLabel: string;
  categories: string[];
  series: { name: string; values: number[] }[];
  width?: number;
  height?: number;
}

/** Grouped vertical bars: one group per category, one bar per series; values printed on top. */
export function barChart(o: BarChartOptions): string {
  const f = frame(o.width ?? 640, o.height ?? 340);
  const pw = f.width - f.left - f.right;
  const ph = f.height - f.top - f.bottom;
  const all = o.series.flatMap((s) => s.values).filter(Number.isFinite);
  const ticks = niceTicks(0, Math.max(1e-9, ...all) * 1.12);
  const ymax = ticks[ticks.length - 1]!;
  const y = (v: number) => f.top + ph - (v / ymax) * ph;
  const out = header(f, o.title);
  for (const t of ticks) {
    out.push(`<line x1="${f.left}" x2="${f.left + pw}" y1="${y(t).toFixed(1)}" y2="${y(t).toFixed(1)}" stroke="#ddd"/>`);
    out.push(`<text x="${f.left - 6}" y="${(y(t) + 4).toFixed(1)}" text-anchor="end">${label(t)}</text>`);
  }
  const gw = pw / Math.max(1, o.categories.length);
  const bw = (gw * 0.75) / Math.max(1, o.series.length);
  o.categories.forEach((c, ci) => {
    const gx = f.left + ci * gw + gw * 0.125;
    o.series.forEach((s, si) => {
      const v = s.values[ci];
      if (v === undefined || !Number.isFinite(v)) return;
      const x = gx + si * bw;
      out.push(`<rect x="${x.toFixed(1)}" y="${y(v).toFixed(1)}" width="${(bw - 2).toFixed(1)}" height="${(f.top + ph - y(v)).toFixed(1)}" fill="${COLORS[si % COLORS.length]}"><title>${esc(`${s.name} ${c}: ${v}`)}</title></rect>`);
      out.push(`<text x="${(x + bw / 2 - 1).toFixed(1)}" y="${(y(v) - 3).toFixed(1)}" text-anchor="middle" font-size="10">${label(v)}</text>`);
    });
    out.push(`<text x="${(f.left + ci * gw + gw / 2).toFixed(1)}" y="${f.top + ph + 16}" text-anchor="middle">${esc(c)}</text>`);
  });
  out.push(`<line x1="${f.left}" x2="${f.left + pw}" y1="${f.top + ph}" y2="${f.top + ph}" stroke="#333"/>`);
  out.push(`<text transform="translate(14 ${f.top + ph / 2}) rotate(-90)" text-anchor="middle">${esc(o.yLabel)}</text>`);
  out.push(...legend(f, o.series.map((s) => s.name)));
  out.push('</svg>');
  return out.join('\n') + '\n';
}

/** Options of `lineChart`. */
export interface LineChartOptions {
  title: string;
  xLabel: string;
  yLabel: string;
  series: { name: string; points: [number, number][]; mode?: 'line' | 'points' | 'both' }[];
  logY?: boolean;
  /** Dashed vertical markers (x values) with an optional legend text. */
  vlines?: { x: number[]; label: string };
  /** Dashed horizontal reference line. */
  hline?: { y: number; label: string };
  width?: number;
  height?: number;
  xMin?: number;
  yMin?: number;
}

/** Lines and/or points on linear x and linear or log10 y axes. */
export function lineChart(o: LineChartOptions): string {
  const f = frame(o.width ?? 640, o.height ?? 340);
  const pw = f.width - f.left - f.right;
  const ph = f.height - f.top - f.bottom;
  const pts = o.series.flatMap((s) => s.points).filter(([x, v]) => Number.isFinite(x) && Number.isFinite(v) && (!o.logY || v > 0));
  const xs = pts.map((p) => p[0]);
  const ys = pts.map((p) => p[1]);
  if (o.hline) ys.push(o.hline.y);
  const xt = niceTicks(o.xMin ?? Math.min(0, ...xs), Math.max(1e-9, ...xs));
  const x0 = xt[0]!;
  const x1 = xt[xt.length - 1]!;
  const X = (x: number) => f.left + ((x - x0) / (x1 - x0 || 1)) * pw;
  let Y: (v: number) => number;
  let yt: number[];
  if (o.logY) {
    const lo = Math.floor(Math.log10(Math.max(1e-6, Math.min(...ys))));
    const hi = Math.ceil(Math.log10(Math.max(...ys, 10 ** (lo + 1))));
    yt = [];
    for (let e = lo; e <= hi; e++) yt.push(10 ** e);
    Y = (v: number) => f.top + ph - ((Math.log10(v) - lo) / (hi - lo || 1)) * ph;
  } else {
    yt = niceTicks(o.yMin ?? Math.min(0, ...ys), Math.max(1e-9, ...ys) * 1.08);
    const y0 = yt[0]!;
    const y1 = yt[yt.length - 1]!;
    Y = (v: number) => f.top + ph - ((v - y0) / (y1 - y0 || 1)) * ph;
  }
  const out = header(f, o.title);
  for (const t of yt) {
    out.push(`<line x1="${f.left}" x2="${f.left + pw}" y1="${Y(t).toFixed(1)}" y2="${Y(t).toFixed(1)}" stroke="#ddd"/>`);
    out.push(`<text x="${f.left - 6}" y="${(Y(t) + 4).toFixed(1)}" text-anchor="end">${label(t)}</text>`);
  }
  for (const t of xt) {
    out.push(`<line x1="${X(t).toFixed(1)}" x2="${X(t).toFixed(1)}" y1="${f.top + ph}" y2="${f.top + ph + 4}" stroke="#333"/>`);
    out.push(`<text x="${X(t).toFixed(1)}" y="${f.top + ph + 16}" text-anchor="middle">${label(t)}</text>`);
  }
  if (o.vlines) {
    for (const x of o.vlines.x) out.push(`<line x1="${X(x).toFixed(1)}" x2="${X(x).toFixed(1)}" y1="${f.top}" y2="${f.top + ph}" stroke="#888" stroke-dasharray="4 3"/>`);
  }
  if (o.hline) {
    const yy = Y(o.hline.y).toFixed(1);
    out.push(`<line x1="${f.left}" x2="${f.left + pw}" y1="${yy}" y2="${yy}" stroke="#888" stroke-dasharray="6 3"/>`);
    out.push(`<text x="${f.left + pw - 4}" y="${Number(yy) - 4}" text-anchor="end" fill="#555">${esc(o.hline.label)}</text>`);
  }
  o.series.forEach((s, si) => {
    const c = COLORS[si % COLORS.length];
    const p = s.points.filter(([x, v]) => Number.isFinite(x) && Number.isFinite(v) && (!o.logY || v > 0));
    const mode = s.mode ?? 'both';
    if (mode !== 'points' && p.length > 1) out.push(`<polyline fill="none" stroke="${c}" stroke-width="1.5" points="${p.map(([x, v]) => `${X(x).toFixed(1)},${Y(v).toFixed(1)}`).join(' ')}"/>`);
    if (mode !== 'line') for (const [x, v] of p) out.push(`<circle cx="${X(x).toFixed(1)}" cy="${Y(v).toFixed(1)}" r="${mode === 'points' ? 2.4 : 3}" fill="${c}"/>`);
  });
  out.push(`<line x1="${f.left}" x2="${f.left + pw}" y1="${f.top + ph}" y2="${f.top + ph}" stroke="#333"/>`);
  out.push(`<line x1="${f.left}" x2="${f.left}" y1="${f.top}" y2="${f.top + ph}" stroke="#333"/>`);
  out.push(`<text x="${f.left + pw / 2}" y="${f.height - 10}" text-anchor="middle">${esc(o.xLabel)}</text>`);
  out.push(`<text transform="translate(14 ${f.top + ph / 2}) rotate(-90)" text-anchor="middle">${esc(o.yLabel)}</text>`);
  out.push(...legend(f, o.series.map((s) => s.name)));
  if (o.vlines) out.push(`<text x="${f.left + pw}" y="39" text-anchor="end" fill="#555">dashed: ${esc(o.vlines.label)}</text>`);
  out.push('</svg>');
  return out.join('\n') + '\n';
}
