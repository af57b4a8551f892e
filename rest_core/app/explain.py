"""A recorded step told in plain words (`explain_step`): what each store found, how the draft tree was built
and cut, where the model parted from it and how sure it was."""
from __future__ import annotations

from typing import Optional

from rest_core.app.markup import token_html
from rest_core.app.policy import markdown_escape
from rest_core.traces import figures, probs
from rest_core.traces.origins import source_words

MODEL_NODE = "the model's own earlier prediction after the same tokens (recycled)"  # a "model" node, in words


def recycled_after(matched: int) -> str:
    """What the model source looked its predictions up after, from its matched_len (2: a pair it had seen)."""
    return "the last two tokens" if matched >= 2 else "the last token"


def _found_by(source: str, matched: int, offered: int, distinct: int) -> str:
    """What one store found for a step's suffix, in words."""
    if source == "model":
        return ("the model had made no prediction after the last token yet, so it had nothing to recycle"
                if not matched else f"the model's own earlier predictions after {recycled_after(matched)} (recycled) "
                                    f"offered {distinct} path{'s' if distinct != 1 else ''}")
    name = source_words(source)
    if not matched:
        return f"{name} found no match"
    return (f"{name} matched the last {matched} tokens and offered {offered} continuation"
            f"{'s' if offered != 1 else ''} ({distinct} distinct)")


def _found_near(source: str, neighbours: list[dict], distinct: int) -> str:
    """What a dense store found, in words: how many places, how near."""
    if not neighbours:
        return (f"{source_words(source)} found no place where the model's state was near and the next token was "
                "the one just committed")
    sims = [n["similarity"] for n in neighbours]
    return (f"{source_words(source)} found {len(neighbours)} place{'s' if len(neighbours) != 1 else ''} where the "
            f"model's hidden state had been near its state now (similarity {max(sims):.2f}"
            f"{f' down to {min(sims):.2f}' if len(sims) > 1 else ''}) and offered what followed them there "
            f"({distinct} distinct)")


def _lookup_sentence(step: dict) -> str:
    """What each store found for the step's suffix, in the order the stores were searched."""
    found: dict[str, list[dict]] = {}
    for b in step["branches"]:
        found.setdefault(b["source"], []).append(b)
    near = step.get("neighbours") or {}
    parts = [_found_near(source, near.get(source, []), len(found.get(source, []))) if source == "dense" else
             _found_by(source, m, sum(b["count"] for b in found.get(source, [])), len(found.get(source, [])))
             for source, m in (step.get("matched_len") or {}).items()]
    text = ("; ".join(parts) + ".") if parts else "No store was searched."
    return text[0].upper() + text[1:]


def _drafted_by(sources: list) -> str:
    """Who drafted the accepted tokens, in words ("the static store", "the model's own earlier prediction ...")."""
    names = sorted(set(sources))
    words = [MODEL_NODE if s == "model" else source_words(s) for s in names]
    return " and ".join(words) if words else "the stores"


def budget_sentence(choice: Optional[dict]) -> str:
    """Why the cost model kept what it kept at a step (its recorded `budget_choice`), or "" when it did not
    choose."""
    if not choice or not choice.get("candidates"):
        return ""
    kept, candidates = int(choice["kept"]), int(choice["candidates"])
    factors = [(src, f) for src, f in (choice.get("request_factors") or {}).items() if abs(f - 1.0) >= 0.05]
    so_far = ("; so far in this answer, drafts from " + ", ".join(
        f"{source_words(src)} landed {f:.2f}× as often as its counts say" for src, f in factors)) if factors else ""
    agreed, by_sources = int(choice.get("agreed") or 0), choice.get("agreement_factors") or []
    if agreed and len(by_sources) > 1 and abs(by_sources[1] - 1.0) >= 0.05:
        so_far += (f"; {agreed} of the candidates were drafted by more than one store, and such tokens have "
                   f"landed {by_sources[1]:.2f}× as often as their store's counts say")
    if kept == 0:
        return (f" The stores offered {candidates} candidate draft token{'s' if candidates != 1 else ''}, but the "
                f"cost model, which weighs each one's chance of being accepted against what a larger pass costs on "
                f"this machine, kept none{so_far}.")
    return (f" Of {candidates} candidate draft token{'s' if candidates != 1 else ''} the cost model kept {kept}: "
            f"it expected {choice['expected_accepted']:.2f} of them to be accepted, for a pass costing "
            f"{choice['relative_cost']:.2f}× a one-token pass{so_far}.")


def _tree_sentence(step: dict, run: dict) -> str:
    """How the draft tree was built and checked, and where the model parted from it."""
    nodes, drafted = step["nodes"], step["draft_size"]
    why = budget_sentence(step.get("budget_choice"))
    if drafted == 0:
        lead = f"{why.strip()} The step" if why else "With nothing to draft, the step"
        return (f"{lead} was an ordinary one: a single forward pass produced one token, "
                f"“{token_html(step['bonus_text'])}”.")
    budget = (run.get("settings") or {}).get("draft_budget", "auto")
    budget_text = "chosen by the cost model" if budget in ("auto", None) else f"at most {budget}"
    fwd = step.get("t_forward_ms")
    fwd_text = f" ({fwd:.0f} ms)" if fwd else ""
    accepted = [n for n in nodes if n["accepted"]][1:]
    path = "".join(n["token_text"] for n in accepted)
    _, offered, model_text = figures.disagreement(step)
    agree = (f"The model agreed with the first {len(accepted)} drafted token"
             f"{'s' if len(accepted) != 1 else ''} (“{token_html(path)}”, drafted by "
             f"{_drafted_by(step.get('accepted_sources') or [])})"
             if accepted else "The model agreed with none of the drafted tokens")
    stop = (f"then, where the draft offered {', '.join('“' + token_html(t) + '”' for t in offered)}, it chose "
            f"“{token_html(model_text)}” instead" if offered else
            f"then the draft ran out and the model added “{token_html(model_text)}”")
    return (f"These were merged into a draft tree of {drafted} token{'s' if drafted != 1 else ''} "
            f"(budget {budget_text}) hanging "
            f"from the last committed token “{token_html(nodes[0]['token_text'])}”, and the model checked every "
            f"branch in one forward pass over {drafted + 1} tokens{fwd_text}, each attending only to the prefix "
            f"and its own ancestors.{why} {agree}; {stop}: that bonus token comes from the model itself.")


def _probability_sentence(step: dict) -> str:
    """How sure the model was where it parted from the draft ("" for a step recorded without probabilities)."""
    if not probs.has_probs(step):
        return ""
    return " " + probs.node_choice_sentence(step, probs.last_accepted(step["nodes"]))


def explain_step(step: dict, run: dict) -> str:
    """One paragraph, in plain words, of what happened at a recorded step (Markdown)."""
    committed = len(step["new_tokens"])
    body = (f"The context ends with “{token_html(step.get('query_text', ''))}”. "
            f"{_lookup_sentence(step)} {_tree_sentence(step, run)}{_probability_sentence(step)} "
            f"The step committed {committed} "
            f"token{'s' if committed != 1 else ''} for one forward pass"
            f"{' (plain decoding: one)' if committed > 1 else ''}.")
    return f"**Step {step['step']}.** {markdown_escape(body)}"  # token texts read as they are, never as markup
