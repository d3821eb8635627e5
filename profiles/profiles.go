// Package profiles holds fifobox's built-in wire profiles, one JSON file
// per existing system (see pkg/wire for the format and docs/adopting-*.md
// for each system's page). FIFOBOX_PROFILE=<name> chooses one; a profile of
// your own is a JSON file in the same format.
package profiles

import "embed"

// FS holds the built-in profiles, <name>.json.
//
//go:embed *.json
var FS embed.FS
