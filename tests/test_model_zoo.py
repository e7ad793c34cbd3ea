"""The transformers model zoo (examples/hf_zoo.py) in CI: every architecture compiled as a module
with default (static) shapes; every other form on a rotating share of the architectures (all of
them by hand: ``python examples/hf_zoo.py``); ``generate`` is in test_generate.py. Each run must be cut,
reduce at least the last attention layer, and match eager transformers (relative error <= 1e-4,
fp32). The Inductor-free ``compiler="eager"`` is used: what is checked is the graph the pass
makes, not Inductor's code for it."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from examples.hf_zoo import ARCHITECTURES, FORMS, missing, run_form  # noqa: E402

NAMES = list(ARCHITECTURES)
OTHER_FORMS = [form for form in FORMS if form != "module"]
# Architecture i runs form i mod 3 besides the module form: every form on five to eight of them.
# Gemma 4, with and without its hand slicing, takes the static form (its dynamic compile costs
# 40-45 s on 2 cores; the transformers fuzz profile compiles Gemma 4 with dynamic=True anyway).
CHEAPER = {"gemma4": "module_k3_padded", "gemma4_no_hand_slicing": "module_k3_padded"}
# Forms an architecture is there for: the routing's token count read as a size (sym_size) under dynamic shapes.
# mistral_large4: the CLA-style sharing of a latent under dynamic shapes (the other forms by hand).
CHOSEN = {"deepseek_v3_moe_last": "dynamic", "mistral_large4": "dynamic", "mistral_large4_own_indexer": "dynamic"}
ROTATION = [(name, CHOSEN.get(name) or CHEAPER.get(name, OTHER_FORMS[i % len(OTHER_FORMS)]))
            for i, name in enumerate(NAMES)]


def run(name: str, form: str):
    if missing(name):
        pytest.skip(f"this transformers has no {missing(name)}")
    return run_form(name, FORMS[form])


def check(record) -> None:
    assert record.cut, record.reason
    assert record.reduced_layers >= 1
    assert record.relative_error <= 1e-4, record


@pytest.mark.parametrize("name", NAMES)
def test_every_architecture_is_cut_as_a_module(name):
    check(run(name, "module"))


@pytest.mark.parametrize("name, form", ROTATION, ids=[f"{n}-{f}" for n, f in ROTATION])
def test_forms_on_a_rotating_share_of_the_architectures(name, form):
    check(run(name, form))


def test_the_rotation_covers_every_form_and_kind():
    forms = {form for _, form in ROTATION}
    assert forms == set(OTHER_FORMS)
    for form in OTHER_FORMS:
        assert sum(f == form for _, f in ROTATION) >= 5, form
