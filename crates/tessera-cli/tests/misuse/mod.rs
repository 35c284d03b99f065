//! Issue 43 through the binary: a misused flag, a hand-edited file or a resource the machine
//! does not have is refused naming the cause and the fix (`flags`), and nothing a user had is
//! lost on the way (`files`).

mod files;
mod flags;
