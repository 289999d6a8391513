"""``python -m phalanx.settings``: every setting as a markdown table (docs/settings.md is its output)."""

from phalanx.settings import table


def markdown() -> str:
    lines = ["# Settings", "",
             "Every `PHALANX_*` variable, generated from `phalanx/settings/areas.py` by",
             "`python -m phalanx.settings > docs/settings.md` (a test checks that this page is its output).",
             "A bad value stops the job at `init()` with one line naming it and what is accepted.", "",
             "| setting | variable | `phalanx run` flag | default | set by | what it does |",
             "|---|---|---|---|---|---|"]
    for row in table():
        name, env, flag, default, who, doc = row
        lines.append(f"| `{name}` | `{env}` | {f'`{flag}`' if flag else ''} | {default} | {who} | {doc} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
