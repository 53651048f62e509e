#!/usr/bin/env bash
# Builds the guide (docs/, an mdBook) into target/book. Installs mdbook 0.5 under target/tools
# when it is missing there (nothing global changes), builds without network access otherwise,
# and fails on any warning or error mdbook prints and on a relative link to a missing file.
# The book's code samples are compiled by the workspace (docs/samples), not here.
set -euo pipefail
cd "$(dirname "$0")/.."

TOOLS="$PWD/target/tools"
MDBOOK="$TOOLS/bin/mdbook"
if ! "$MDBOOK" --version 2>/dev/null | grep -q '^mdbook v0\.5\.'; then
  echo "lily: installing mdbook 0.5 into $TOOLS" >&2
  cargo install mdbook --version '^0.5' --no-default-features --features search --locked \
    --root "$TOOLS" --quiet
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! "$MDBOOK" build docs >"$log" 2>&1; then
  cat "$log" >&2
  echo "lily: the book did not build" >&2
  exit 1
fi
if grep -E '(WARN|ERROR)' "$log" >&2; then
  echo "lily: mdbook printed warnings or errors (above)" >&2
  exit 1
fi

# Relative links in the chapters must name files that exist (mdbook does not check them).
status=0
for page in docs/src/*.md; do
  dir=$(dirname "$page")
  while IFS= read -r target; do
    path=${target%%#*}
    [ -z "$path" ] && continue
    if [ ! -e "$dir/$path" ]; then
      echo "lily: $page links to $target, which does not exist" >&2
      status=1
    fi
  done < <(grep -oE '\]\([^)[:space:]]+\)' "$page" | sed -E 's/^\]\((.*)\)$/\1/' |
    grep -vE '^(https?:|mailto:|#)' || true)
done
# Every included anchor exists (mdbook includes nothing, silently, for an unknown one).
while IFS=: read -r page file anchor; do
  if ! grep -q "ANCHOR: $anchor\$" "$(dirname "$page")/$file" 2>/dev/null; then
    echo "lily: $page includes anchor '$anchor' of $file, which has none" >&2
    status=1
  fi
done < <(grep -oE '\{\{#include [^}:]+:[A-Za-z0-9_-]+\}\}' docs/src/*.md |
  sed -E 's/^([^:]+):\{\{#include ([^}:]+):([^}]+)\}\}$/\1:\2:\3/')
[ "$status" -eq 0 ] || exit 1
echo "lily: the book is in target/book/index.html" >&2
