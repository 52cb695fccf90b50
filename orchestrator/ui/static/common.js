// What the dashboard and the chaos report pages share: the state badge, the summary cards, the
// plotly charts, table cells and the polling loop.  Each page defines its own refresh() and hands
// it to poll().
"use strict";
const REFRESH_MS = 2000;
let refreshes = 0;

function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text;
  if (cls) td.className = cls;
}

function setState(live, text) {
  const state = document.getElementById("state");
  state.textContent = text;
  state.className = "badge" + (live ? " live" : "");
}

// One card per [label, value] row in the element `boxId`; a card whose label is in `badLabels`
// is marked bad when its value is neither "0" nor "-".
function renderCards(boxId, rows, badLabels = []) {
  document.getElementById(boxId).replaceChildren(...rows.map(([label, value]) => {
    const card = document.createElement("div");
    card.className = "card" + (badLabels.includes(label) && value !== "0" && value !== "-" ? " bad" : "");
    card.innerHTML = '<div class="label"></div><div class="value"></div>';
    card.children[0].textContent = label;
    card.children[1].textContent = value;
    return card;
  }));
}

// The figures (id -> plotly figure) in #charts: a div per id, made the first time, redrawn after.
function renderCharts(figures) {
  const box = document.getElementById("charts");
  for (const [id, fig] of Object.entries(figures)) {
    let div = document.getElementById("chart-" + id);
    if (!div) {
      div = document.createElement("div");
      div.id = "chart-" + id;
      div.className = "chart";
      box.appendChild(div);
    }
    Plotly.react(div, fig.data, fig.layout, {displaylogo: false, responsive: true});
  }
}

// Calls refresh() (which answers whether there is more to come) every REFRESH_MS while the run is
// live; a finished run never changes, so its page stops polling.  body's data-refreshes counts the
// refreshes done and data-polling says whether it still polls.
async function poll(refresh) {
  let live = true;
  try {
    live = await refresh();
    document.body.dataset.refreshes = String(++refreshes);
  } catch (e) {
    console.warn("refresh failed, retrying:", e);
  }
  document.body.dataset.polling = live ? "on" : "off";
  if (live) setTimeout(() => poll(refresh), REFRESH_MS);
}
