#!/bin/sh
# Install what tests/explain/test_browser.py needs: a system Chromium and Playwright's Python package.
# Non-interactive; never fails the build: without apt-get, root or a network the browser test skips
# (saying why). Playwright's own browser download is never used (it cannot work offline).
# Usage: .ci/install-browser.sh [PYTHON]   (default: .venv/bin/python, else python3)
PYTHON="${1:-}"
if [ -z "$PYTHON" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

have_browser() {
    command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 \
        || command -v google-chrome >/dev/null 2>&1
}

if have_browser; then
    echo "install-browser: Chromium already present"
elif command -v apt-get >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" != "0" ]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; fi
    fi
    if [ "$(id -u)" = "0" ] || [ -n "$SUDO" ]; then
        echo "install-browser: installing chromium with apt-get"
        export DEBIAN_FRONTEND=noninteractive
        $SUDO apt-get update -qq >/dev/null 2>&1 || echo "install-browser: apt-get update failed (offline?)"
        $SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1 \
            || echo "install-browser: apt-get install chromium failed; the browser test will skip"
    else
        echo "install-browser: not root and no sudo; the browser test will skip"
    fi
else
    echo "install-browser: no apt-get here; install Chromium yourself or the browser test will skip"
fi

if "$PYTHON" -c "import playwright" >/dev/null 2>&1; then
    echo "install-browser: playwright present"
else
    "$PYTHON" -m pip install --quiet "playwright>=1.40" \
        || echo "install-browser: pip install playwright failed; the browser test will skip"
fi
exit 0
