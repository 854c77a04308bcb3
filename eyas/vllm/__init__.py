"""vLLM in the loop: the environment eyas finds it in (env), worker scripts run by vLLM's own python
(each imports vLLM, never eyas), and the clients that read their results."""
