// Package docs holds fifobox's documentation (Markdown); this test keeps its
// links, and the commands it names, pointing at things that exist.
package docs

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

var (
	fence      = regexp.MustCompile("(?s)```.*?```")
	codeSpan   = regexp.MustCompile("`[^`\n]*`")
	mdLink     = regexp.MustCompile(`\[[^\]]*\]\(([^)\s]+)(?:\s+"[^"]*")?\)`)
	heading    = regexp.MustCompile(`(?m)^#{1,6}\s+(.+?)\s*#*\s*$`)
	makeTarget = regexp.MustCompile(`(?:^|[\s;&|(])make\s+([a-z][a-z-]*)`)
	repoPath   = regexp.MustCompile(`(?:^|[\s(])\.?/?((?:scripts|infra/scripts|localstack)/[\w.-]+\.(?:sh|mjs)|(?:cmd|pkg|functions|internal)/[\w/.-]*\w)`)
)

// docFiles are the Markdown files a reader navigates: the README, docs/ and
// the CDK app's README, relative to the repository root.
func docFiles(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob("*.md")
	if err != nil {
		t.Fatal(err)
	}
	out := []string{"README.md", "infra/README.md"}
	for _, f := range files {
		out = append(out, filepath.Join("docs", f))
	}
	return out
}

// anchors are the GitHub-style fragment ids of a Markdown file's headings.
func anchors(md string) map[string]bool {
	out := map[string]bool{}
	seen := map[string]int{}
	for _, m := range heading.FindAllStringSubmatch(fence.ReplaceAllString(md, ""), -1) {
		var b strings.Builder
		for _, r := range strings.ToLower(m[1]) {
			switch {
			case r == ' ':
				b.WriteRune('-')
			case r == '-' || r == '_' || r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r > 127:
				b.WriteRune(r)
			}
		}
		id := b.String()
		if n := seen[id]; n > 0 {
			out[id+"-"+string(rune('0'+n))] = true
		} else {
			out[id] = true
		}
		seen[id]++
	}
	return out
}

// Every relative link of the README and docs/ resolves to a file, and every
// #anchor to a heading of it; every `make` target and every script or
// package path the docs name in code exists.
func TestDocLinks(t *testing.T) {
	root := ".."
	makefile, err := os.ReadFile(filepath.Join(root, "Makefile"))
	if err != nil {
		t.Fatal(err)
	}
	targets := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^([a-z][a-z-]*):`).FindAllStringSubmatch(string(makefile), -1) {
		targets[m[1]] = true
	}
	links := 0
	for _, rel := range docFiles(t) {
		path := filepath.Join(root, rel)
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		md := string(b)
		prose := codeSpan.ReplaceAllString(fence.ReplaceAllString(md, ""), "")
		for _, m := range mdLink.FindAllStringSubmatch(prose, -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			links++
			file, frag, _ := strings.Cut(target, "#")
			dest := path
			if file != "" {
				dest = filepath.Join(filepath.Dir(path), file)
				if _, err := os.Stat(dest); err != nil {
					t.Errorf("%s: link %s: %s does not exist", rel, target, file)
					continue
				}
			}
			if frag == "" {
				continue
			}
			db, err := os.ReadFile(dest)
			if err != nil {
				t.Errorf("%s: link %s: anchor into %s, which is not a file", rel, target, file)
				continue
			}
			if !anchors(string(db))[frag] {
				t.Errorf("%s: link %s: no heading with anchor #%s in %s", rel, target, frag, dest)
			}
		}
		var code strings.Builder
		for _, c := range fence.FindAllString(md, -1) {
			code.WriteString(c + "\n")
		}
		for _, c := range codeSpan.FindAllString(md, -1) {
			code.WriteString(strings.Trim(c, "`") + "\n")
		}
		for _, m := range makeTarget.FindAllStringSubmatch(code.String(), -1) {
			if !targets[m[1]] {
				t.Errorf("%s: `make %s`: no such Makefile target", rel, m[1])
			}
		}
		for _, m := range repoPath.FindAllStringSubmatch(code.String(), -1) {
			p := strings.TrimSuffix(m[1], "/...")
			// pkg/db.Env names an identifier in a package: check the package.
			if i := strings.LastIndex(p, "."); i > strings.LastIndex(p, "/") && i+1 < len(p) && p[i+1] >= 'A' && p[i+1] <= 'Z' {
				p = p[:i]
			}
			if strings.ContainsAny(p, "*<") {
				continue
			}
			if _, err := os.Stat(filepath.Join(root, p)); err != nil {
				t.Errorf("%s: names %s, which does not exist", rel, m[1])
			}
		}
	}
	if links < 20 {
		t.Errorf("found only %d relative links: is the parser broken?", links)
	}
}
