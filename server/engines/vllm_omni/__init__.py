"""The vLLM-Omni engine: the AR (thinker) stage of an omni teacher scored through vLLM-Omni's
AsyncOmni (`engine`), started under its deadline from a stage config of proctor's (`startup`,
`config`); what a request sends (`prompts`), how a finished output is read into rows
(`outputs`, `prompt_logprobs`) and the stage error shapes it knows (`stages`)."""
