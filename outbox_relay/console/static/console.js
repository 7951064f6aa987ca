// The console's one script: ticking "select all" ticks every dead letter of the page. Everything works
// without it.
document.addEventListener("DOMContentLoaded", () => {
  for (const all of document.querySelectorAll("input.select-all")) {
    all.addEventListener("change", () => {
      for (const box of all.closest("form").querySelectorAll('input[name="event"]')) {
        box.checked = all.checked;
      }
    });
  }
});
