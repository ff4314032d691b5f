"""A randomised generator of genuine MoE variants and look-alikes (issue 13, part 5).

``recipe.draw_recipe`` draws a form (loop, sort + grouped_mm, gathered weights, dense, padded capacity, split loop)
and then the idioms valid for it (selection, expert storage, router, weight position, combine, a loop's guard,
capacity style, biases and dropouts), or a look-alike (a flaw that makes it a different function); the forms of a
family of their own (MiniMind's cumulative host walk, v4.36 Mixtral's ``.tolist()`` row lists: ``walks_lists.py``)
only when named (``draw_recipe(..., forms=WALKS_LISTS)``, ``--walks-lists``), so each seed's general draws stay as
they were; ``check.run`` builds the module, compiles it with moe_inductor and says whether it was rewritten and equal to eager.
``python -m tests.generator`` measures the rewrite rate per form and idiom over many recipes;
``tests/test_generator.py`` runs a few dozen under hypothesis.
"""
