"""The Jinja chat templates of models ctxfold has presets for, kept as data so nothing is downloaded.

Each is the model's own ``chat_template`` text, byte for byte as its publisher ships it, with where it
was taken from and under which terms. They are rendered by :mod:`ctxfold.tokens.templates.jinja` exactly as
transformers' ``apply_chat_template`` renders them.
"""

from __future__ import annotations

# Gemma 3 instruction-tuned models (google/gemma-3-*-it, tokenizer_config.json "chat_template"; the same
# text in every size). Gemma is provided under the Gemma Terms of Use (https://ai.google.dev/gemma/terms),
# which allow redistribution with that notice. The template folds the system prompt into the first user
# turn, trims every content, has no tool role and raises on anything but alternating user/assistant turns.
GEMMA3 = (
    '{{ bos_token }}\n'
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n"
    '\n'
    "' -%}\n"
    '    {%- else -%}\n'
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n"
    '\n'
    "' -%}\n"
    '    {%- endif -%}\n'
    '    {%- set loop_messages = messages[1:] -%}\n'
    '{%- else -%}\n'
    '    {%- set first_user_prefix = "" -%}\n'
    '    {%- set loop_messages = messages -%}\n'
    '{%- endif -%}\n'
    '{%- for message in loop_messages -%}\n'
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}\n'
    '    {%- endif -%}\n'
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    '    {%- else -%}\n'
    "        {%- set role = message['role'] -%}\n"
    '    {%- endif -%}\n'
    "    {{ '<start_of_turn>' + role + '\n"
    '\' + (first_user_prefix if loop.first else "") }}\n'
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    '            {%- endif -%}\n'
    '        {%- endfor -%}\n'
    '    {%- else -%}\n'
    '        {{ raise_exception("Invalid content type") }}\n'
    '    {%- endif -%}\n'
    "    {{ '<end_of_turn>\n"
    "' }}\n"
    '{%- endfor -%}\n'
    '{%- if add_generation_prompt -%}\n'
    "    {{'<start_of_turn>model\n"
    "'}}\n"
    '{%- endif -%}\n'
)

# Llama 3.1 instruct (meta-llama/Llama-3.1-8B-Instruct, tokenizer_config.json "chat_template", as
# llama.cpp's models/templates keeps it). Llama 3.1 is licensed under the Llama 3.1 Community License,
# Copyright (c) Meta Platforms, Inc. All Rights Reserved. Built with Llama.
LLAMA31 = (
    '{{- bos_token }}\n'
    '{%- if custom_tools is defined %}\n'
    '    {%- set tools = custom_tools %}\n'
    '{%- endif %}\n'
    '{%- if not tools_in_user_message is defined %}\n'
    '    {%- set tools_in_user_message = true %}\n'
    '{%- endif %}\n'
    '{%- if not date_string is defined %}\n'
    '    {%- set date_string = "26 Jul 2024" %}\n'
    '{%- endif %}\n'
    '{%- if not tools is defined %}\n'
    '    {%- set tools = none %}\n'
    '{%- endif %}\n'
    '\n'
    '{#- This block extracts the system message, so we can slot it into the right place. #}\n'
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content']|trim %}\n"
    '    {%- set messages = messages[1:] %}\n'
    '{%- else %}\n'
    '    {%- set system_message = "" %}\n'
    '{%- endif %}\n'
    '\n'
    '{#- System message + builtin tools #}\n'
    '{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}\n'
    '{%- if builtin_tools is defined or tools is not none %}\n'
    '    {{- "Environment: ipython\\n" }}\n'
    '{%- endif %}\n'
    '{%- if builtin_tools is defined %}\n'
    '    {{- "Tools: " + builtin_tools | reject(\'equalto\', \'code_interpreter\') | join(", ") + "\\n\\n"}}\n'
    '{%- endif %}\n'
    '{{- "Cutting Knowledge Date: December 2023\\n" }}\n'
    '{{- "Today Date: " + date_string + "\\n\\n" }}\n'
    '{%- if tools is not none and not tools_in_user_message %}\n'
    '    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}\n'
    '    {{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\' }}\n'
    '    {{- "Do not use variables.\\n\\n" }}\n'
    '    {%- for t in tools %}\n'
    '        {{- t | tojson(indent=4) }}\n'
    '        {{- "\\n\\n" }}\n'
    '    {%- endfor %}\n'
    '{%- endif %}\n'
    '{{- system_message }}\n'
    '{{- "<|eot_id|>" }}\n'
    '\n'
    '{#- Custom tools are passed in a user message with some extra guidance #}\n'
    '{%- if tools_in_user_message and not tools is none %}\n'
    '    {#- Extract the first user message so we can plug it in here #}\n'
    '    {%- if messages | length != 0 %}\n'
    "        {%- set first_user_message = messages[0]['content']|trim %}\n"
    '        {%- set messages = messages[1:] %}\n'
    '    {%- else %}\n'
    '        {{- raise_exception("Cannot put tools in the first user message when there\'s no first user message!") }}\n'
    '{%- endif %}\n'
    "    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}\n"
    '    {{- "Given the following functions, please respond with a JSON for a function call " }}\n'
    '    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}\n'
    '    {{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\' }}\n'
    '    {{- "Do not use variables.\\n\\n" }}\n'
    '    {%- for t in tools %}\n'
    '        {{- t | tojson(indent=4) }}\n'
    '        {{- "\\n\\n" }}\n'
    '    {%- endfor %}\n'
    '    {{- first_user_message + "<|eot_id|>"}}\n'
    '{%- endif %}\n'
    '\n'
    '{%- for message in messages %}\n'
    "    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}\n"
    "        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}\n"
    "    {%- elif 'tool_calls' in message %}\n"
    '        {%- if not message.tool_calls|length == 1 %}\n'
    '            {{- raise_exception("This model only supports single tool-calls at once!") }}\n'
    '        {%- endif %}\n'
    '        {%- set tool_call = message.tool_calls[0].function %}\n'
    '        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}\n'
    "            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
    '            {{- "<|python_tag|>" + tool_call.name + ".call(" }}\n'
    '            {%- for arg_name, arg_val in tool_call.arguments | items %}\n'
    '                {{- arg_name + \'="\' + arg_val + \'"\' }}\n'
    '                {%- if not loop.last %}\n'
    '                    {{- ", " }}\n'
    '                {%- endif %}\n'
    '                {%- endfor %}\n'
    '            {{- ")" }}\n'
    '        {%- else  %}\n'
    "            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
    '            {{- \'{"name": "\' + tool_call.name + \'", \' }}\n'
    '            {{- \'"parameters": \' }}\n'
    '            {{- tool_call.arguments | tojson }}\n'
    '            {{- "}" }}\n'
    '        {%- endif %}\n'
    '        {%- if builtin_tools is defined %}\n'
    "            {#- This means we're in ipython mode #}\n"
    '            {{- "<|eom_id|>" }}\n'
    '        {%- else %}\n'
    '            {{- "<|eot_id|>" }}\n'
    '        {%- endif %}\n'
    '    {%- elif message.role == "tool" or message.role == "ipython" %}\n'
    '        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}\n'
    '        {%- if message.content is mapping or message.content is iterable %}\n'
    '            {{- message.content | tojson }}\n'
    '        {%- else %}\n'
    '            {{- message.content }}\n'
    '        {%- endif %}\n'
    '        {{- "<|eot_id|>" }}\n'
    '    {%- endif %}\n'
    '{%- endfor %}\n'
    '{%- if add_generation_prompt %}\n'
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    '{%- endif %}\n'
)

# Llama 3.2 instruct (meta-llama/Llama-3.2-3B-Instruct, the same provenance): 3.1's without built-in tools,
# and with today's date (strftime_now) in the system turn. Llama 3.2 is licensed under the Llama 3.2
# Community License, Copyright (c) Meta Platforms, Inc. All Rights Reserved. Built with Llama.
LLAMA32 = (
    '{{- bos_token }}\n'
    '{%- if custom_tools is defined %}\n'
    '    {%- set tools = custom_tools %}\n'
    '{%- endif %}\n'
    '{%- if not tools_in_user_message is defined %}\n'
    '    {%- set tools_in_user_message = true %}\n'
    '{%- endif %}\n'
    '{%- if not date_string is defined %}\n'
    '    {%- if strftime_now is defined %}\n'
    '        {%- set date_string = strftime_now("%d %b %Y") %}\n'
    '    {%- else %}\n'
    '        {%- set date_string = "26 Jul 2024" %}\n'
    '    {%- endif %}\n'
    '{%- endif %}\n'
    '{%- if not tools is defined %}\n'
    '    {%- set tools = none %}\n'
    '{%- endif %}\n'
    '\n'
    '{#- This block extracts the system message, so we can slot it into the right place. #}\n'
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content']|trim %}\n"
    '    {%- set messages = messages[1:] %}\n'
    '{%- else %}\n'
    '    {%- set system_message = "" %}\n'
    '{%- endif %}\n'
    '\n'
    '{#- System message #}\n'
    '{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}\n'
    '{%- if tools is not none %}\n'
    '    {{- "Environment: ipython\\n" }}\n'
    '{%- endif %}\n'
    '{{- "Cutting Knowledge Date: December 2023\\n" }}\n'
    '{{- "Today Date: " + date_string + "\\n\\n" }}\n'
    '{%- if tools is not none and not tools_in_user_message %}\n'
    '    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}\n'
    '    {{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\' }}\n'
    '    {{- "Do not use variables.\\n\\n" }}\n'
    '    {%- for t in tools %}\n'
    '        {{- t | tojson(indent=4) }}\n'
    '        {{- "\\n\\n" }}\n'
    '    {%- endfor %}\n'
    '{%- endif %}\n'
    '{{- system_message }}\n'
    '{{- "<|eot_id|>" }}\n'
    '\n'
    '{#- Custom tools are passed in a user message with some extra guidance #}\n'
    '{%- if tools_in_user_message and not tools is none %}\n'
    '    {#- Extract the first user message so we can plug it in here #}\n'
    '    {%- if messages | length != 0 %}\n'
    "        {%- set first_user_message = messages[0]['content']|trim %}\n"
    '        {%- set messages = messages[1:] %}\n'
    '    {%- else %}\n'
    '        {{- raise_exception("Cannot put tools in the first user message when there\'s no first user message!") }}\n'
    '{%- endif %}\n'
    "    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}\n"
    '    {{- "Given the following functions, please respond with a JSON for a function call " }}\n'
    '    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}\n'
    '    {{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\' }}\n'
    '    {{- "Do not use variables.\\n\\n" }}\n'
    '    {%- for t in tools %}\n'
    '        {{- t | tojson(indent=4) }}\n'
    '        {{- "\\n\\n" }}\n'
    '    {%- endfor %}\n'
    '    {{- first_user_message + "<|eot_id|>"}}\n'
    '{%- endif %}\n'
    '\n'
    '{%- for message in messages %}\n'
    "    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}\n"
    "        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}\n"
    "    {%- elif 'tool_calls' in message %}\n"
    '        {%- if not message.tool_calls|length == 1 %}\n'
    '            {{- raise_exception("This model only supports single tool-calls at once!") }}\n'
    '        {%- endif %}\n'
    '        {%- set tool_call = message.tool_calls[0].function %}\n'
    "        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
    '        {{- \'{"name": "\' + tool_call.name + \'", \' }}\n'
    '        {{- \'"parameters": \' }}\n'
    '        {{- tool_call.arguments | tojson }}\n'
    '        {{- "}" }}\n'
    '        {{- "<|eot_id|>" }}\n'
    '    {%- elif message.role == "tool" or message.role == "ipython" %}\n'
    '        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}\n'
    '        {%- if message.content is mapping or message.content is iterable %}\n'
    '            {{- message.content | tojson }}\n'
    '        {%- else %}\n'
    '            {{- message.content }}\n'
    '        {%- endif %}\n'
    '        {{- "<|eot_id|>" }}\n'
    '    {%- endif %}\n'
    '{%- endfor %}\n'
    '{%- if add_generation_prompt %}\n'
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    '{%- endif %}\n'
)
