"""The app's screens, each with its stylesheet beside it: the chat, and the help and stats modals."""
