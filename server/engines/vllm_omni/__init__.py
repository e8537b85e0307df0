"""The vLLM-Omni engine: the AR (thinker) stage of an omni teacher scored through vLLM-Omni's
AsyncOmni (`engine`), its stage settings (`config`), stage error shapes (`stages`) and the
generation API's prompt log-probs read into rows (`prompt_logprobs`)."""
