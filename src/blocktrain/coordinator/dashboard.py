"""The live dashboard at ``/``: one static page that polls ``/v1/status``."""

from __future__ import annotations

DASHBOARD_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>BlockTrain coordinator</title>
<style>
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin-bottom:1.2em}
td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}
th{background:#f3f3f3}
.state-open{color:#06c}.state-finished{color:#090}.live-false{color:#b00}
</style></head>
<body>
<h1>BlockTrain coordinator</h1>
<p id="summary">loading&hellip;</p>
<h2>Blocks</h2>
<table id="blocks"><thead><tr><th>block</th><th>version</th><th>round</th><th>updates</th>
<th>live replicas</th><th>deadline in (s)</th><th>state</th><th>outer step</th></tr></thead><tbody></tbody></table>
<h2>Workers</h2>
<table id="workers"><thead><tr><th>worker</th><th>block</th><th>state</th><th>live</th><th>accepted</th>
<th>rejected</th><th>bytes in</th><th>bytes out</th></tr></thead><tbody></tbody></table>
<h2>Validation CE (nats/byte)</h2>
<svg id="ce" width="520" height="220" viewBox="0 0 520 220" role="img" aria-label="CE curve"></svg>
<h2>Recent rounds</h2>
<table id="rounds"><thead><tr><th>block</th><th>version</th><th>closed by</th><th>accepted</th><th>rejected</th>
<th>push bytes</th><th>step bytes</th><th>groups (sizes)</th></tr></thead>
<tbody></tbody></table>
<script>
function cell(v){const td=document.createElement('td');td.textContent=v;return td;}
function fill(id, rows){
  const tb=document.querySelector('#'+id+' tbody'); tb.replaceChildren();
  for(const r of rows){
    const tr=document.createElement('tr'); for(const v of r){tr.appendChild(cell(v));} tb.appendChild(tr);
  }
}
function curve(evals){
  const svg=document.getElementById('ce'); svg.replaceChildren();
  if(!evals.length) return;
  const W=520,H=220,P=30, xs=evals.map(e=>e.epoch), ys=evals.map(e=>e.ce_nats_per_byte);
  const x0=Math.min(...xs), x1=Math.max(...xs)||1, y0=Math.min(...ys), y1=Math.max(...ys);
  const sx=x=>P+(W-2*P)*((x-x0)/((x1-x0)||1)), sy=y=>H-P-(H-2*P)*((y-y0)/((y1-y0)||1));
  const pl=document.createElementNS('http://www.w3.org/2000/svg','polyline');
  pl.setAttribute('points', evals.map(e=>sx(e.epoch)+','+sy(e.ce_nats_per_byte)).join(' '));
  pl.setAttribute('fill','none'); pl.setAttribute('stroke','#06c'); pl.setAttribute('stroke-width','2');
  pl.id='ce-line'; pl.dataset.points=String(evals.length); svg.appendChild(pl);
  const t=document.createElementNS('http://www.w3.org/2000/svg','text');
  t.setAttribute('x',P); t.setAttribute('y',16); t.textContent='latest '+ys[ys.length-1].toFixed(4);
  svg.appendChild(t);
}
async function refresh(){
  try{
    const s=await (await fetch('/v1/status')).json();
    document.getElementById('summary').textContent =
      `preset ${s.preset} (${s.objective}), ${s.n_blocks} blocks, ${s.rounds_closed} rounds closed, ${s.updates_accepted} updates, `+
      `${s.bytes_in} B in, ${s.bytes_out} B out, `+
      `latest CE ${s.latest_eval_ce===null?'n/a':s.latest_eval_ce.toFixed(4)}`+
      (s.finished?' (finished)':'');
    fill('blocks', s.blocks.map(b=>[b.block,b.version,b.round_state,b.updates_in_round,b.live_replicas,
                                    b.deadline_in.toFixed(1),b.state,
                                    `${b.outer.method} lr ${b.outer.lr}`+(b.outer.momentum===null?'':` mu ${b.outer.momentum}`)+
                                    `, ${b.outer.step_encoding} step, ${b.outer.aggregation}`]));
    fill('workers', s.workers.map(w=>[w.name,w.block,w.state,w.live,w.updates_accepted,w.updates_rejected,
                                      w.bytes_in,w.bytes_out]));
    fill('rounds', s.rounds.slice(0,20).map(r=>[r.block,r.version,r.close_reason,r.updates,
      Object.entries(r.rejected).map(([k,n])=>`${k} ${n}`).join(', ')||'0',r.push_bytes,r.step_bytes,
      r.groups.length?`${r.groups.length} (${r.groups.join(', ')})`:'-']));
    curve(s.evals);
    document.body.dataset.refreshed=String(Date.now());
  }catch(e){document.getElementById('summary').textContent='status unavailable: '+e;}
}
refresh(); setInterval(refresh, 2000);
</script></body></html>
"""
