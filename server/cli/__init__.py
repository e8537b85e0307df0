"""The `proctor` command (`main`): it composes the server's parts and, for `verify` and `demo`,
the trainer side (`trainer_side`); `score` (`proctor score`), `quickstart` (the built-in tiny
teacher served in one call) and the tiny models `make-tiny-model` builds (`tiny_model`,
`tiny_multimodal`)."""
