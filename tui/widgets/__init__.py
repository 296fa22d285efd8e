"""The chat's widgets, one per module: the conversation's parts and the live panel's gauges."""
