#!/usr/bin/env bash
# Rebuilds offline.html, the page template `dvc plots show` fills (.dvc/config:
# plots.html_template): DVC's own template loads Vega from a CDN, a blank page offline.
# This one carries the same Vega releases that DVC's renderer targets (dvc-render 1.0.2:
# vega 5.20.2, vega-lite 5.2.0, vega-embed 6.18.2), inline, from the npm registry,
# checked against the sha256 sums below, and draws in SVG. Run it from anywhere: `bash .dvc/plots/build.sh`.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
declare -A sha=(
  [vega@5.20.2]=4794d0169cb1f3ebad8117fe98ba5bd652dd725905ec0384e832391dbccb03be
  [vega-lite@5.2.0]=d73157451b3978015ab31dacd55ff90d986ab8663fc0abed50f97b3cd90002cb
  [vega-embed@6.18.2]=1ba9826431ddc9805e815ad92acc811c819f2bfd32bda2a128b8c4b5070fab5e
)
{
  cat <<'HEAD'
<!DOCTYPE html>
<!-- Built by .dvc/plots/build.sh: DVC's page with the Vega bundle inline, so that
     `dvc plots show` works offline. vega 5.20.2, vega-lite 5.2.0, vega-embed 6.18.2:
     BSD-3-Clause, Copyright (c) the University of Washington Interactive Data Lab. -->
<html>
<head>
    {refresh_tag}
    <meta charset="utf-8">
    <title>DVC Plot</title>
HEAD
  for pkg in vega@5.20.2 vega-lite@5.2.0 vega-embed@6.18.2; do
    (cd "$work" && npm pack --silent "$pkg" >/dev/null)
    name=${pkg%@*}
    tar -xzf "$work/$name-${pkg#*@}.tgz" -C "$work" "package/build/$name.min.js"
    echo "${sha[$pkg]}  $work/package/build/$name.min.js" | sha256sum --check --quiet
    printf '    <script>/* %s */\n' "$pkg"
    cat "$work/package/build/$name.min.js"
    printf '\n    </script>\n'
  done
  cat <<'TAIL'
    <script>
        // SVG, not vega-embed's default canvas: sharp at any zoom, and the marks are in
        // the DOM (tests/integration/test_pipeline.py checks the rendered curves there).
        const dvcVegaEmbed = window.vegaEmbed;
        window.vegaEmbed = (el, spec, options) => dvcVegaEmbed(el, spec, {renderer: "svg", ...options});
    </script>
    <style>
        table {
            border-spacing: 15px;
        }
    </style>
</head>
<body>
    {plot_divs}
</body>
</html>
TAIL
} >"$here/offline.html.tmp"
mv "$here/offline.html.tmp" "$here/offline.html"
echo "wrote $here/offline.html"
