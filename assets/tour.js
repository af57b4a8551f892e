// REST Lab page script: the tour's highlight and the keyboard.
// The tour's card (#tour-card .tour-card) names the element to highlight in data-target; whenever the
// page changes, the named element gets the .tour-target outline and is scrolled into view once.
// Keys: while the tour is open, → / PageDown next stop, ← / PageUp back, Esc closes (a presentation
// clicker sends these); otherwise, on the Step through tab, ← / → previous / next step, Home / End
// first / last step.  Keys typed into a text box, a list or a slider are left alone.
(() => {
  if (window.restLabTour) return;
  window.restLabTour = true;

  const shown = (el) => !!el && el.offsetParent !== null;
  let current = null;

  const highlight = () => {
    const card = document.querySelector("#tour-card .tour-card");
    const id = shown(card) ? card.dataset.target : null;
    const key = id ? `${id}:${card.dataset.stop}` : null;
    const target = id ? document.getElementById(id) : null;
    document.querySelectorAll(".tour-target").forEach((el) => { if (el !== target) el.classList.remove("tour-target"); });
    if (document.body && document.body.classList.contains("touring") !== !!id) {
      document.body.classList.toggle("touring", !!id);
    }
    if (target && !target.classList.contains("tour-target")) target.classList.add("tour-target");  // again after
    if (target && key !== current) target.scrollIntoView({ behavior: "smooth", block: "start" });  // a redraw
    current = target ? key : null;
  };

  let queued = false;
  const soon = () => {
    if (queued) return;
    queued = true;
    requestAnimationFrame(() => { queued = false; highlight(); });
  };
  // the page may add this script after it has loaded: watch the whole document from now on
  new MutationObserver(soon).observe(document.documentElement,
    { childList: true, subtree: true, attributes: true, attributeFilter: ["class", "style", "data-target"] });

  const press = (id) => {
    const button = document.getElementById(id);
    if (!shown(button) || button.disabled) return false;
    button.click();
    return true;
  };
  const typing = (el) => !!el && (el.isContentEditable || ["INPUT", "TEXTAREA", "SELECT"].includes(el.tagName)
    || el.getAttribute("role") === "listbox" || el.getAttribute("role") === "combobox");

  document.addEventListener("keydown", (event) => {
    if (event.altKey || event.ctrlKey || event.metaKey || typing(event.target)) return;
    const touring = shown(document.querySelector("#tour-card .tour-card"));
    const keys = touring
      ? { ArrowRight: "tour-next", PageDown: "tour-next", ArrowLeft: "tour-back", PageUp: "tour-back",
          Escape: "tour-close" }
      : { ArrowRight: "step-forward", ArrowLeft: "step-back", Home: "step-first", End: "step-last" };
    const id = keys[event.key];
    if (id && press(id)) event.preventDefault();
  });
})();
