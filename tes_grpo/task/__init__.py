"""The task and its data: the plant, the prompt that describes it and the format gpt-oss reads and writes.

- tes_env: the TES plant, its series and its exact Q-values (QSolver)
- tes_policies: the rule policies, the random and the optimal policy, the closed loop (simulate_batch)
- task_prompt: the operator's prompt for a state, and the two-part text the Q datasets store
- harmony: gpt-oss's Harmony format: the tokenizer, rendering prompts, reasoning effort, token ids, parse_action
"""
