"""Draw docs/'s pictures of the two pages from a trained run, in Debian's Chromium.

    python benchmarks/screenshots.py --demo runs/demo-… --tutorial runs/tutorial

writes docs/explain.png (the demo model's page of the walkthrough's 77-character prompt from its load
charts down: the attention map, cut by chunk boundaries), docs/explain-tutorial.png (the tutorial
preset, top-2, in train mode: capacity acting, rerouted slots outlined, each load chart against its
capacity line) and
docs/serve-tutorial.png (the served page after a generation, one token's route open). Look at them
before committing: a picture is checked by eye, not by this script.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-headless-shell")
LONG_PROMPT = "ROMEO: What say you, lady? Speak, I pray, for I would know the cause of this."


def explain_page(run: str, prompt: str, out: Path, *extra: str) -> Path:
    subprocess.run([sys.executable, "-m", "nanollama4", "explain", run, "--prompt", prompt, "--html", str(out),
                    *extra], check=True, stdout=subprocess.DEVNULL)
    return out


def shoot(browser, url: str, path: Path, height: int, scroll_to: str | None = None) -> None:
    """The page's first `height` pixels, or those from the element `scroll_to` names."""
    page = browser.new_page(viewport={"width": 1300, "height": height})
    page.goto(url)
    page.wait_for_selector("body[data-ready=yes]")
    if scroll_to:
        page.locator(scroll_to).scroll_into_view_if_needed()
        page.evaluate("s => document.querySelector(s).scrollIntoView()", scroll_to)
    page.screenshot(path=str(path))
    page.close()


def served_page(browser, run: str, path: Path) -> None:
    """Serve the run on a free port, generate from the page as a visitor would, open one token's route."""
    proc = subprocess.Popen([sys.executable, "-m", "nanollama4", "serve", run, "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = re.search(r"http://127\.0\.0\.1:\d+", proc.stdout.readline())[0]
        page = browser.new_page(viewport={"width": 1300, "height": 1000})
        page.goto(url + "/")
        page.fill("#prompt", "ROMEO:")
        page.fill("#max_tokens", "60")
        page.fill("#temperature", "0.8")
        page.fill("#seed", "1")
        page.click("#generate")
        page.wait_for_selector("body[data-state=done]", timeout=120_000)
        page.locator(".tok.gen").nth(8).click()
        page.screenshot(path=str(path), full_page=True)
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", required=True)
    parser.add_argument("--tutorial", required=True)
    parser.add_argument("--work", type=Path, default=Path("runs/screenshots"))
    a = parser.parse_args()
    if CHROMIUM is None:
        sys.exit("no chromium on PATH: apt install chromium (a downloaded browser is never used)")
    from playwright.sync_api import sync_playwright

    a.work.mkdir(parents=True, exist_ok=True)
    demo = explain_page(a.demo, LONG_PROMPT, a.work / "demo.html")
    tutorial = explain_page(a.tutorial, "Facebook was founded", a.work / "tutorial.html", "--mode", "train",
                            "--seed", "1")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        shoot(browser, demo.resolve().as_uri(), DOCS / "explain.png", height=1150, scroll_to="#load")
        shoot(browser, tutorial.resolve().as_uri(), DOCS / "explain-tutorial.png", height=1250)
        served_page(browser, a.tutorial, DOCS / "serve-tutorial.png")
        browser.close()
    print("wrote docs/explain.png, docs/explain-tutorial.png, docs/serve-tutorial.png: look at them", file=sys.stderr)


if __name__ == "__main__":
    main()
