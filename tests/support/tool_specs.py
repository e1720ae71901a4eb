"""The tool specs the tests give sessions and servers, each defined once."""

#: A Realtime function tool (the OpenAI ``tools`` entry), as the tool tests use it.
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}

#: The same tool with its argument required (the prompt-rendering tests' spec).
WEATHER_CITY_REQUIRED = {
    **WEATHER,
    "parameters": {**WEATHER["parameters"], "required": ["city"]},
}
