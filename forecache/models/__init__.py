"""Which model a run loads: what ``-m`` accepts (``names``) and the built-in default model, made
on first use (``default``)."""
