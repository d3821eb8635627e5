package docs

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/fifobox/fifobox/internal/cli"
	"github.com/fifobox/fifobox/internal/invoketest"
	lambdaredrive "github.com/fifobox/fifobox/pkg/lambdafn/redrive"
	"github.com/fifobox/fifobox/pkg/redrive"
	"github.com/fifobox/fifobox/pkg/runbook"
)

// words splits a shell line into words (quotes kept out, no expansion).
func words(line string) []string {
	var out []string
	var cur strings.Builder
	in := false
	var q byte
	flush := func() {
		if in {
			out = append(out, cur.String())
			cur.Reset()
			in = false
		}
	}
	for i := 0; i < len(line); i++ {
		c := line[i]
		switch {
		case q != 0 && c == q:
			q = 0
		case q != 0:
			cur.WriteByte(c)
		case c == '\'' || c == '"':
			q, in = c, true
		case c == ' ' || c == '\t' || c == '\n':
			flush()
		default:
			cur.WriteByte(c)
			in = true
		}
	}
	flush()
	return out
}

// logicalLines joins continued lines and drops comments and blanks.
func logicalLines(body string) []string {
	var out []string
	var cur string
	for _, l := range strings.Split(body, "\n") {
		if i := strings.Index(l, " #"); i >= 0 && !strings.Contains(l[:i], "'") {
			l = l[:i]
		}
		if strings.HasPrefix(strings.TrimSpace(l), "#") {
			l = ""
		}
		l = strings.TrimRight(l, " \t")
		if strings.HasSuffix(l, "\\") {
			cur += strings.TrimSuffix(l, "\\") + " "
			continue
		}
		cur += l
		if strings.TrimSpace(cur) != "" {
			out = append(out, strings.TrimSpace(cur))
		}
		cur = ""
	}
	return out
}

var placeholder = regexp.MustCompile(`<([a-z-]+)>`)

// samples stand in for a documented placeholder.
var samples = map[string]string{
	"consumer": "shipping", "event-id": "0193c1f4-1c2d-7000-8000-000000000001", "message-key": "0193c1f4-1c2d-7000-8000-000000000002",
	"group": "order-2", "aggregate-type": "order", "aggregate-id": "order-2", "time": "2026-11-01", "reason": "why", "function": "Fifobox-Stateless-Redrive",
}

func fill(s string, vals map[string]string) string {
	return placeholder.ReplaceAllStringFunc(s, func(m string) string {
		k := m[1 : len(m)-1]
		if v, ok := vals[k]; ok {
			return v
		}
		if v, ok := samples[k]; ok {
			return v
		}
		return "x"
	})
}

// command is one documented command line, classified.
type command struct {
	where string
	kind  string // fifobox, lambda, cdk, other
	args  []string
	text  string
}

func classify(where, line string) command {
	w := words(line)
	for len(w) > 0 && regexp.MustCompile(`^[A-Z_][A-Z0-9_]*=`).MatchString(w[0]) {
		w = w[1:] // VAR=value before the command
	}
	c := command{where: where, text: line, kind: "other"}
	switch {
	case len(w) >= 1 && w[0] == "fifobox":
		c.kind, c.args = "fifobox", w[1:]
	case len(w) >= 3 && w[0] == "go" && w[1] == "run" && w[2] == "./cmd/fifobox":
		c.kind, c.args = "fifobox", w[3:]
	case len(w) >= 3 && w[0] == "aws" && w[1] == "lambda" && w[2] == "invoke":
		c.kind, c.args = "lambda", w[3:]
	case len(w) >= 1 && w[0] == "cdk":
		c.kind = "cdk"
	case len(w) >= 2 && w[0] == "go" && w[1] == "test":
		c.kind, c.args = "gotest", w[2:]
	}
	return c
}

// payload is an `aws lambda invoke` line's --payload.
func payload(c command) (string, error) {
	for i, a := range c.args {
		if a == "--payload" && i+1 < len(c.args) {
			if !containsSeq(c.args, "--cli-binary-format", "raw-in-base64-out") {
				return "", fmt.Errorf("needs --cli-binary-format raw-in-base64-out (the aws CLI v2 reads --payload as base64 otherwise)")
			}
			return c.args[i+1], nil
		}
	}
	return "", fmt.Errorf("no --payload")
}

func containsSeq(ss []string, a, b string) bool {
	for i := 0; i+1 < len(ss); i++ {
		if ss[i] == a && ss[i+1] == b {
			return true
		}
	}
	return false
}

// docCommands are every command of the docs' shell and runbook blocks.
func docCommands(t *testing.T) []command {
	var out []command
	for _, b := range allBlocks(t) {
		if b.lang != "sh" && b.marker != "runbook" && !goCommands(b) {
			continue
		}
		for _, l := range logicalLines(b.body) {
			out = append(out, classify(fmt.Sprintf("%s:%d", b.file, b.line), l))
		}
	}
	return out
}

// Every fifobox command line in the docs' shell blocks parses with the
// CLI's own command table and is valid as the CLI checks it before it runs
// (flags, values, required ones); every `aws lambda invoke` payload is an
// operation the redrive Lambda accepts; nobody is told to run a bare
// `cdk` (the pinned CLI is under .tools: the infra scripts run it).
func TestDocCommands(t *testing.T) {
	n := 0
	for _, c := range docCommands(t) {
		switch c.kind {
		case "fifobox":
			n++
			args := make([]string, len(c.args))
			for i, a := range c.args {
				args[i] = fill(a, nil)
			}
			if _, err := cli.Check(args); err != nil {
				t.Errorf("%s: %s: %v", c.where, c.text, err)
			}
		case "lambda":
			n++
			p, err := payload(c)
			if err == nil {
				_, err = redrive.DecodeCommand([]byte(fill(p, nil)), "")
			}
			if err != nil {
				t.Errorf("%s: %s: %v", c.where, c.text, err)
			}
		case "cdk":
			t.Errorf("%s: %s: run cdk through ./infra/scripts (deploy.sh, synth.sh): a bare cdk is not on PATH (the pinned CLI is in .tools)", c.where, c.text)
		case "gotest":
			if err := checkGoTest(c.args); err != nil {
				t.Errorf("%s: %s: %v", c.where, c.text, err)
			}
		}
	}
	if n < 20 {
		t.Errorf("only %d documented commands found: is the parser broken?", n)
	}
}

var inlineFifobox = regexp.MustCompile("`(fifobox [^`]+)`")

// Commands named inline in prose and tables name real commands and flags
// (they may leave out required values: "`fifobox redrive`" names the
// command).
func TestInlineCommandsExist(t *testing.T) {
	for _, rel := range docFiles(t) {
		b, err := os.ReadFile(filepath.Join("..", rel))
		if err != nil {
			t.Fatal(err)
		}
		prose := fence.ReplaceAllString(string(b), "")
		for _, m := range inlineFifobox.FindAllStringSubmatch(prose, -1) {
			// Prose may mark optional parts ([--group G]) and elide (...).
			text := strings.NewReplacer("[", "", "]", "").Replace(fill(m[1], nil))
			args := slices.DeleteFunc(words(text)[1:], func(w string) bool { return w == "..." })
			if _, err := cli.Check(args); err != nil && !strings.Contains(err.Error(), "required") && !strings.Contains(err.Error(), "choose") &&
				!strings.Contains(err.Error(), "needs an argument") {
				t.Errorf("%s: `%s`: %v", rel, m[1], err)
			}
		}
	}
}

// The commands alarms name (pkg/runbook, which the CDK app writes into
// the alarm descriptions) are valid CLI lines, the subscription-DLQ ones
// move from the subscription DLQ; and where templates were synthesised,
// every command an alarm description names parses.
func TestAlarmCommands(t *testing.T) {
	var names []string
	for n := range runbook.All {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		for _, line := range runbook.All[n] {
			w := words(fill(line, nil))
			if w[0] != "fifobox" {
				t.Errorf("runbook %s: %q is not a fifobox command", n, line)
				continue
			}
			if _, err := cli.Check(w[1:]); err != nil {
				t.Errorf("runbook %s: %s: %v", n, line, err)
			}
		}
	}
	for _, line := range runbook.SubscriptionDLQMessages {
		if !strings.Contains(line, "--from subscription-dlq") {
			t.Errorf("subscription DLQ step %q does not take its messages from the subscription DLQ", line)
		}
	}
	files, _ := filepath.Glob("../infra/cdk.out*/*.template.json")
	if len(files) == 0 {
		if os.Getenv("FIFOBOX_REQUIRE_SYNTH") == "1" {
			t.Fatal("no synthesised templates in infra/cdk.out*: run make synth")
		}
		t.Log("no synthesised templates (make synth): checked pkg/runbook only")
		return
	}
	found := 0
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var tpl struct {
			Resources map[string]struct {
				Type       string
				Properties struct {
					AlarmName        any
					AlarmDescription string
				}
			}
		}
		if err := json.Unmarshal(b, &tpl); err != nil {
			t.Fatal(err)
		}
		for id, r := range tpl.Resources {
			if r.Type != "AWS::CloudWatch::Alarm" {
				continue
			}
			for _, m := range inlineFifobox.FindAllStringSubmatch(r.Properties.AlarmDescription, -1) {
				found++
				if _, err := cli.Check(words(fill(m[1], nil))[1:]); err != nil {
					t.Errorf("%s %s: `%s`: %v", filepath.Base(f), id, m[1], err)
				}
			}
			if strings.Contains(strings.ToLower(r.Properties.AlarmDescription), "subscription dlq") && strings.Contains(r.Properties.AlarmDescription, "fifobox redrive") &&
				!strings.Contains(r.Properties.AlarmDescription, "--from subscription-dlq") {
				t.Errorf("%s %s: a subscription-DLQ alarm tells to redrive from the consumer queue's DLQ: %s", filepath.Base(f), id, r.Properties.AlarmDescription)
			}
		}
	}
	if found == 0 {
		t.Error("no alarm description names a fifobox command: is the parser broken?")
	}
}

// A runbook block pairs each CLI line with the `aws lambda invoke` line of
// the same operation. Both decode to the same command, and every step runs
// through the redrive Lambda's real handler, in the order written, on the
// pipeline the docs describe (the CLI line with --via-lambda, the invoke
// line's payload as the function receives it).
func TestRunbook(t *testing.T) {
	var steps []command
	for _, b := range allBlocks(t) {
		if b.marker != "runbook" {
			continue
		}
		for _, l := range logicalLines(b.body) {
			steps = append(steps, classify(fmt.Sprintf("%s:%d", b.file, b.line), l))
		}
	}
	if len(steps) < 10 {
		t.Fatalf("only %d runbook lines: is docs/operations.md's runbook there?", len(steps))
	}
	run := &docRun{}
	sc := run.scenario(t)
	h, err := lambdaredrive.New(sc.service, lambdaredrive.Config{})
	if err != nil {
		t.Fatal(err)
	}
	srv := invoketest.New(t, h.Invoke)
	vals := map[string]string{"event-id": sc.deadID, "message-key": sc.poison}
	for i := 0; i < len(steps); i++ {
		c := steps[i]
		if c.kind != "fifobox" {
			t.Errorf("%s: runbook line %q: want a fifobox line, each followed by its aws lambda invoke line", c.where, c.text)
			continue
		}
		if i+1 >= len(steps) || steps[i+1].kind != "lambda" {
			t.Errorf("%s: %q has no aws lambda invoke line after it", c.where, c.text)
			continue
		}
		inv := steps[i+1]
		i++
		args := make([]string, len(c.args))
		for k, a := range c.args {
			args[k] = fill(a, vals)
		}
		fromCLI, err := cli.Check(args)
		if err != nil {
			t.Errorf("%s: %s: %v", c.where, c.text, err)
			continue
		}
		p, err := payload(inv)
		if err != nil {
			t.Errorf("%s: %s: %v", inv.where, inv.text, err)
			continue
		}
		p = fill(p, vals)
		fromLambda, err := redrive.DecodeCommand([]byte(p), "")
		if err != nil {
			t.Errorf("%s: %s: %v", inv.where, inv.text, err)
			continue
		}
		// A time given as a duration ago ("24h") is read at two moments.
		for _, f := range []struct{ a, b **redrive.Instant }{{&fromCLI.Since, &fromLambda.Since}, {&fromCLI.Until, &fromLambda.Until}} {
			if *f.a != nil && *f.b != nil && (*f.a).Sub((*f.b).Time).Abs() < time.Minute {
				*f.b = *f.a
			}
		}
		a, _ := fromCLI.JSON()
		b, _ := fromLambda.JSON()
		if !bytes.Equal(a, b) {
			t.Errorf("%s: %q and its invoke line differ:\n  CLI    %s\n  Lambda %s", c.where, c.text, a, b)
			continue
		}
		// Through the handler: the invoke line's payload, then the CLI
		// line itself with --via-lambda (a dry run or a read: a change
		// would run twice).
		t.Setenv("AWS_ENDPOINT_URL", srv.URL)
		if _, err := h.Invoke(context.Background(), []byte(p)); err != nil {
			t.Errorf("%s: the Lambda ran %s: %v", inv.where, p, err)
			continue
		}
		if fromCLI.DryRun || fromCLI.Operation == redrive.OpStatus || fromCLI.Operation == redrive.OpDLQList || fromCLI.Operation == redrive.OpDeadList ||
			fromCLI.Operation == redrive.OpAudit {
			var out, errOut bytes.Buffer
			if err := cli.Run(context.Background(), &out, &errOut, append([]string{"--via-lambda", "fifobox-redrive"}, args...)...); err != nil &&
				fromCLI.Operation != redrive.OpStatus {
				t.Errorf("%s: fifobox --via-lambda fifobox-redrive %s: %v\n%s", c.where, strings.Join(args, " "), err, errOut.String())
			}
		}
		sc.setEnv(t)
	}
}

// checkGoTest checks a documented `go test` line: its packages exist and
// its -run/-bench patterns name tests or benchmarks they define.
func checkGoTest(args []string) error {
	var pkgs, patterns []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		switch {
		case (a == "-run" || a == "-bench") && i+1 < len(args):
			if p := args[i+1]; p != "^$" && p != "." {
				patterns = append(patterns, p)
			}
			i++
		case a == "-benchtime" || a == "-count" || a == "-timeout" || a == "-fuzztime" || a == "-fuzz" || a == "-tags":
			i++
		case strings.HasPrefix(a, "./"):
			pkgs = append(pkgs, strings.TrimSuffix(strings.TrimSuffix(a, "/..."), "/"))
		}
	}
	var src strings.Builder
	for _, p := range pkgs {
		dir := filepath.Join("..", p)
		files, err := filepath.Glob(filepath.Join(dir, "*_test.go"))
		if err != nil || len(files) == 0 {
			return fmt.Errorf("package %s has no tests", p)
		}
		for _, f := range files {
			b, _ := os.ReadFile(f)
			src.Write(b)
		}
	}
	for _, p := range patterns {
		re, err := regexp.Compile(p)
		if err != nil {
			return err
		}
		found := false
		for _, m := range regexp.MustCompile(`(?m)^func ((?:Test|Benchmark|Fuzz)\w+)\(`).FindAllStringSubmatch(src.String(), -1) {
			if re.MatchString(m[1]) {
				found = true
			}
		}
		if !found {
			return fmt.Errorf("no test or benchmark in %v matches %q", pkgs, p)
		}
	}
	return nil
}
