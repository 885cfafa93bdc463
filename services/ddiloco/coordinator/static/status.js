// The coordinator's live status page: fetches status.json every 2 s and redraws. No library,
// nothing from the network but this coordinator; text goes in as textContent, never as HTML
// (datacenter labels and event details come from the learners).
"use strict";

const COLORS = { merged: "#17803d", lost_in_crash: "#c0262d", refused_stale: "#e07b00", restarting: "#7b4fc0", waiting: "#9aa3b2" };
const $ = (id) => document.getElementById(id);
const mb = (b) => (b / 1e6).toFixed(2);
const num = (x) => x.toLocaleString("en-US");

function seconds(s) {
  if (s < 120) return s.toFixed(0) + " s";
  if (s < 7200) return (s / 60).toFixed(1) + " min";
  return (s / 3600).toFixed(1) + " h";
}

function fill(tableId, rows) {
  const body = $(tableId).tBodies[0];
  body.replaceChildren(...rows.map((cells) => {
    const tr = document.createElement("tr");
    for (const c of cells) {
      const td = document.createElement("td");
      if (c !== null && typeof c === "object") {
        td.textContent = c.text;
        td.className = c.cls;
      } else {
        td.textContent = c === null || c === undefined ? "–" : String(c);
      }
      tr.appendChild(td);
    }
    return tr;
  }));
}

function svgEl(name, attrs, text) {
  const el = document.createElementNS("http://www.w3.org/2000/svg", name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

function drawCurve(points) {
  const svg = $("curve");
  const W = 560, H = 240, L = 48, R = 12, T = 12, B = 28;
  const parts = [svgEl("rect", { x: L, y: T, width: W - L - R, height: H - T - B, fill: "none", stroke: "#ccd" })];
  if (points.length) {
    const xs = points.map((p) => p[0]), ys = points.map((p) => p[2]);
    const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1);
    let y0 = Math.min(...ys), y1 = Math.max(...ys);
    if (y1 - y0 < 1e-6) { y0 -= 0.5; y1 += 0.5; }
    const sx = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
    const sy = (y) => T + (y1 - y) / (y1 - y0) * (H - T - B);
    const d = points.map((p, i) => (i ? "L" : "M") + sx(p[0]).toFixed(1) + "," + sy(p[2]).toFixed(1)).join(" ");
    parts.push(svgEl("path", { d, fill: "none", stroke: "#2458c6", "stroke-width": 2 }));
    for (const p of points) parts.push(svgEl("circle", { cx: sx(p[0]), cy: sy(p[2]), r: 2.5, fill: "#2458c6" }));
    parts.push(svgEl("text", { x: L - 4, y: T + 10, "text-anchor": "end", "font-size": 11 }, y1.toFixed(2)));
    parts.push(svgEl("text", { x: L - 4, y: H - B, "text-anchor": "end", "font-size": 11 }, y0.toFixed(2)));
    parts.push(svgEl("text", { x: L, y: H - 8, "font-size": 11 }, seconds(x0)));
    parts.push(svgEl("text", { x: W - R, y: H - 8, "text-anchor": "end", "font-size": 11 }, seconds(x1)));
    parts.push(svgEl("text", { x: (L + W - R) / 2, y: H - 8, "text-anchor": "middle", "font-size": 11, fill: "#667" },
      "seconds since the first learner joined"));
  } else {
    parts.push(svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle", fill: "#889" }, "no evaluation yet"));
  }
  svg.replaceChildren(...parts);
}

function drawGoodput(gp) {
  const bar = $("buckets"), legend = $("bucket-legend");
  if (!gp) { bar.replaceChildren(); legend.textContent = "computed from metrics.jsonl every 10 s"; return; }
  const shares = { merged: gp.goodput, ...gp.waste };
  const segs = [], keys = [];
  for (const [k, v] of Object.entries(shares)) {
    const d = document.createElement("div");
    d.style.width = (100 * v).toFixed(2) + "%";
    d.style.background = COLORS[k] || "#555";
    d.title = k + " " + (100 * v).toFixed(1) + "%";
    segs.push(d);
    const s = document.createElement("span"), i = document.createElement("i");
    i.style.background = COLORS[k] || "#555";
    s.append(i, k.replaceAll("_", " ") + " " + (100 * v).toFixed(1) + "%");
    keys.push(s);
  }
  bar.replaceChildren(...segs);
  legend.replaceChildren(...keys);
}

function render(s) {
  $("run-id").textContent = s.run_id;
  $("state").textContent = s.state;
  $("elapsed").textContent = seconds(s.elapsed_s) + " / " + seconds(s.max_seconds);
  $("tokens").textContent = num(s.tokens);
  const o = s.outer;
  $("version").textContent = o ? String(o.version) : "–";
  $("loss").textContent = o && o.eval_loss !== null ? o.eval_loss.toFixed(4) : "–";
  $("goodput").textContent = s.goodput ? (100 * s.goodput.goodput).toFixed(1) + "%" + (s.goodput.frozen ? " (stopped)" : "") : "–";
  fill("members", s.members.map((m) => [
    m.learner, m.datacenter || "–", m.ranks, { text: m.state, cls: "state-" + m.state }, m.incarnation, num(m.tokens), num(m.inner_steps),
    m.version, m.behind, m.in_flight, mb(m.bytes_uploaded), mb(m.bytes_downloaded),
    (100 * m.compute_utilization).toFixed(0) + "%", m.heartbeat_age_s.toFixed(1) + " s",
  ]));
  fill("fragments", o ? o.fragments.map((f) => [f.fragment, f.version, num(f.tokens_merged)]) : []);
  fill("links", s.links.map((l) => [
    l.datacenter, mb(l.bytes_uploaded), mb(l.bytes_downloaded), mb(l.up_bytes_per_s), mb(l.down_bytes_per_s),
  ]));
  drawCurve(s.curve);
  drawGoodput(s.goodput);
  fill("events", s.events.length ? s.events.map((e) => [seconds(e.age_s) + " ago", e.source, e.event, e.detail])
    : [["–", "", "none", ""]]);
  document.body.dataset.updated = String(s.generated_t);
}

async function refresh() {
  const fresh = $("freshness");
  try {
    const r = await fetch("status.json", { cache: "no-store" });
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(await r.json());
    fresh.textContent = "updated " + new Date().toLocaleTimeString();
    fresh.className = "fresh";
  } catch (err) {
    fresh.textContent = "coordinator unreachable (" + err.message + "); retrying";
    fresh.className = "stale";
  }
}

refresh();
setInterval(refresh, 2000);
