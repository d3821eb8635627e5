package docs

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// A fenced block of a Markdown file, with the marker comment on the line
// before it, if any: <!-- output: NAME --> (the block is golden file
// testdata/NAME.txt, produced by a test), <!-- runbook --> (pairs of CLI
// and `aws lambda invoke` lines run through the Lambda handler) or
// <!-- not checked: why --> (a diagram, or a snippet of another language).
type block struct {
	file   string // relative to the repository root
	line   int    // of the opening fence, 1-based
	lang   string
	marker string // "output", "runbook", "not checked", or ""
	arg    string // the output's name, or why it is not checked
	body   string
	start  int // byte offsets of body in the file
	end    int
}

var (
	fenceOpen = regexp.MustCompile("(?m)^```([a-z]*)[ \t]*$")
	markerRe  = regexp.MustCompile(`^<!--\s*(output|runbook|not checked)\s*:?\s*(.*?)\s*-->$`)
)

// parseBlocks returns md's fenced blocks.
func parseBlocks(file, md string) []block {
	var out []block
	pos := 0
	for {
		loc := fenceOpen.FindStringSubmatchIndex(md[pos:])
		if loc == nil {
			return out
		}
		open, bodyStart := pos+loc[0], pos+loc[1]+1
		if bodyStart > len(md) {
			return out
		}
		rest := md[bodyStart:]
		close := strings.Index(rest, "```")
		for close > 0 && rest[close-1] != '\n' {
			next := strings.Index(rest[close+3:], "```")
			if next < 0 {
				close = -1
				break
			}
			close += 3 + next
		}
		if close < 0 {
			return out
		}
		b := block{file: file, line: strings.Count(md[:open], "\n") + 1, lang: md[pos+loc[2] : pos+loc[3]],
			body: rest[:close], start: bodyStart, end: bodyStart + close}
		before := strings.TrimRight(md[:open], "\n")
		if i := strings.LastIndexByte(before, '\n'); i >= 0 {
			before = before[i+1:]
		}
		if m := markerRe.FindStringSubmatch(strings.TrimSpace(before)); m != nil {
			b.marker, b.arg = m[1], m[2]
		}
		out = append(out, b)
		pos = bodyStart + close + 3
	}
}

// allBlocks are the fenced blocks of every documentation file.
func allBlocks(t *testing.T) []block {
	t.Helper()
	var out []block
	for _, rel := range docFiles(t) {
		b, err := os.ReadFile(filepath.Join("..", rel))
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, parseBlocks(rel, string(b))...)
	}
	return out
}

// Every fenced block is checked by something: its shell commands parse
// with the CLI (TestDocCommands), its output is produced by a test
// (TestDocOutputs), it is a runbook run through the Lambda handler
// (TestRunbook), or a marker says why not (a diagram, a JSON topology the
// transports' own file tests load, code in another language).
func TestEveryBlockIsChecked(t *testing.T) {
	for _, b := range allBlocks(t) {
		switch {
		case b.marker == "not checked" && b.arg == "":
			t.Errorf("%s:%d: <!-- not checked --> without a reason", b.file, b.line)
		case b.marker != "":
		case b.lang == "sh" || b.lang == "go" || b.lang == "json" || b.lang == "sql" || b.lang == "ts" || b.lang == "python":
			// sh: TestDocCommands; the rest are code and data, not output.
		case goCommands(b):
			// go test lines: TestDocCommands.
		default:
			t.Errorf("%s:%d: a block without a language must be marked output, runbook or not checked (with why):\n%s", b.file, b.line, b.body)
		}
	}
}

// goCommands reports whether every line of b is a go command (a benchmark
// to run), which TestDocCommands checks.
func goCommands(b block) bool {
	lines := logicalLines(b.body)
	for _, l := range lines {
		if !strings.HasPrefix(l, "go ") {
			return false
		}
	}
	return len(lines) > 0
}
