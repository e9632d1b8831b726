# Sourced: find_python312 prints a Python 3.12 interpreter (PATH, then pyenv) or returns 1.
find_python312() {
    for cand in python3.12 "$HOME/.pyenv/versions/3.12.1/bin/python3.12"; do
        if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
            command -v "$cand"; return 0
        fi
    done
    for cand in "$HOME"/.pyenv/versions/3.12.*/bin/python3.12; do
        [ -x "$cand" ] && { echo "$cand"; return 0; }
    done
    return 1
}
