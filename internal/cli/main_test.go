package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fifobox/fifobox/internal/pgtest"
	"github.com/fifobox/fifobox/pkg/redrive"
)

// fakeLambda serves the Lambda Invoke API: it records each request and
// answers with the next canned response.
type fakeLambda struct {
	mu       sync.Mutex
	paths    []string
	payloads []map[string]any
	respond  func(w http.ResponseWriter)
}

func (f *fakeLambda) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	var p map[string]any
	_ = json.Unmarshal(body, &p)
	f.mu.Lock()
	f.paths = append(f.paths, r.Method+" "+r.URL.Path)
	f.payloads = append(f.payloads, p)
	f.mu.Unlock()
	f.respond(w)
}

func runCLI(t *testing.T, args ...string) (stdout, stderr string, err error) {
	t.Helper()
	var out, errOut bytes.Buffer
	a := &app{out: &out, errOut: &errOut}
	root := a.rootCmd()
	root.SetArgs(args)
	root.SetOut(&out)
	root.SetErr(&errOut)
	err = root.ExecuteContext(context.Background())
	return out.String(), errOut.String(), err
}

func lambdaEnv(t *testing.T, h http.Handler) {
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	lambdaEndpoint(t, srv.URL)
}

// lambdaEndpoint points the AWS SDK at url (a fake Lambda Invoke API).
func lambdaEndpoint(t *testing.T, url string) {
	t.Setenv("AWS_ENDPOINT_URL", url)
	t.Setenv("AWS_REGION", "us-east-1")
	t.Setenv("AWS_ACCESS_KEY_ID", "test")
	t.Setenv("AWS_SECRET_ACCESS_KEY", "test")
	t.Setenv("FIFOBOX_REDRIVE_FUNCTION", "")
}

// --via-lambda sends the same JSON command the local path executes, and
// prints the function's result.
func TestViaLambdaSendsTheCommand(t *testing.T) {
	f := &fakeLambda{respond: func(w http.ResponseWriter) {
		_, _ = w.Write([]byte(`{"operation":"dead-requeue","audit_id":7,"affected":3,"aggregates":2,"message":"requeued 3 dead events of 2 aggregates"}`))
	}}
	lambdaEnv(t, f)
	out, _, err := runCLI(t, "--via-lambda", "fifobox-redrive", "--actor", "alice@laptop",
		"dead", "requeue", "--event-id", "0193c1f4-1c2d-7000-8000-000000000001", "--aggregate-type", "order")
	if err != nil {
		t.Fatal(err)
	}
	if want := "requeued 3 dead events of 2 aggregates (audit #7)"; !strings.Contains(out, want) {
		t.Fatalf("output %q, want %q", out, want)
	}
	if len(f.paths) != 1 || f.paths[0] != "POST /2015-03-31/functions/fifobox-redrive/invocations" {
		t.Fatalf("requests %v", f.paths)
	}
	p := f.payloads[0]
	if p["operation"] != "dead-requeue" || p["actor"] != "alice@laptop" || p["aggregate_type"] != "order" {
		t.Fatalf("payload %v", p)
	}
	if ids, _ := p["event_ids"].([]any); len(ids) != 1 || ids[0] != "0193c1f4-1c2d-7000-8000-000000000001" {
		t.Fatalf("event_ids %v", p["event_ids"])
	}
}

// A function error (the redrive Lambda refused the command) is the CLI's
// error, with the function's message.
func TestViaLambdaFunctionError(t *testing.T) {
	lambdaEnv(t, &fakeLambda{respond: func(w http.ResponseWriter) {
		w.Header().Set("X-Amz-Function-Error", "Unhandled")
		_, _ = w.Write([]byte(`{"errorMessage":"replay: selected events were pruned","errorType":"errorString"}`))
	}})
	_, _, err := runCLI(t, "--via-lambda", "fifobox-redrive", "replay", "--consumer", "audit", "--aggregate-type", "order", "--since", "7d")
	if err == nil || !strings.Contains(err.Error(), "selected events were pruned") {
		t.Fatalf("err = %v, want the function's message", err)
	}
}

// Bad flags fail before anything is sent, naming the flag.
func TestFlagValidation(t *testing.T) {
	f := &fakeLambda{respond: func(w http.ResponseWriter) { _, _ = w.Write([]byte(`{}`)) }}
	lambdaEnv(t, f)
	tests := []struct {
		args []string
		want string
	}{
		{[]string{"redrive"}, "--consumer: required"},
		{[]string{"redrive", "--consumer", "audit", "--from", "elsewhere"}, "--from"},
		{[]string{"replay", "--aggregate-type", "order"}, "--consumer: required"},
		{[]string{"replay", "--consumer", "audit", "--aggregate-type", "order"}, "--since: required"},
		{[]string{"dead", "list", "--limit", "-1"}, "--limit: -1: must be at least 1"},
		{[]string{"dead", "requeue", "--event-id", "nope"}, "--event-id"},
		{[]string{"dlq", "discard", "--consumer", "audit", "--reason", "x"}, "--message: choose"},
		{[]string{"dlq", "discard", "--consumer", "audit", "--group", "g"}, "--reason: required"},
		{[]string{"redrive", "--consumer", "audit", "--older-than", "1d"}, "unknown flag: --older-than"},
		{[]string{"replay", "--consumer", "audit", "--since", "yesterday"}, "--since"},
		{[]string{"dead", "requeue", "--until", "soon"}, "--until"},
		// Retention guards: checked before the function is invoked, and by it.
		{[]string{"prune", "--older-than", "0s"}, "--older-than"},
		{[]string{"prune", "--older-than", "23h"}, "--older-than: 23h0m0s: want at least 1d"},
		{[]string{"prune", "--inbox-older-than", "336h"}, "--inbox-older-than: 14d: want at least 15d"},
		{[]string{"prune", "--inbox-older-than", "a month"}, "--inbox-older-than"},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			_, _, err := runCLI(t, append([]string{"--via-lambda", "fn"}, tt.args...)...)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("err = %v, want it to name %s", err, tt.want)
			}
		})
	}
	if len(f.paths) != 0 {
		t.Fatalf("invalid commands reached the Lambda: %v", f.paths)
	}
}

// status separates what is due from what backs off and what is parked: each
// has its own meaning (and its own alarm).
func TestStatusShowsTheSplitBacklog(t *testing.T) {
	var out bytes.Buffer
	ok := redrive.Section{State: redrive.StateOK}
	printStatus(&out, &redrive.Status{State: redrive.StateOK, Outbox: redrive.OutboxStatus{Section: ok, Pending: 9, DueEvents: 3,
		InFlightAggregates: 1, BackingOffEvents: 2, RetryingAggregates: 1, ParkedEvents: 4, ParkedAggregates: 2, Dead: 2,
		OldestDueAge: redrive.Duration(1500 * time.Millisecond), OldestTransactionAge: redrive.Duration(95 * time.Second), OldestTransactionPartial: true},
		Errors: redrive.ErrorsStatus{Section: ok}, Queues: redrive.QueuesStatus{Section: ok}})
	for _, want := range []string{"3 events, 1 aggregates in flight", "1.5s",
		"2 events, 1 aggregates retrying", "4 events, 2 aggregates, 2 dead",
		"oldest open transaction (server)    1m35s (the migration owner's sessions only"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("status lacks %q:\n%s", want, out.String())
		}
	}
}

// Progress on stderr: plain lines when stderr is not a terminal (no \r),
// redrawn in place on a terminal, and never above 100 %: a count past the
// total counted at the start shows without a percentage.
func TestProgressNeverExceedsAHundredPercent(t *testing.T) {
	for _, tty := range []bool{false, true} {
		var out bytes.Buffer
		p := &progress{w: &out, tty: tty}
		for _, n := range []int64{1, 2, 3, 4, 5} {
			p.report("redrive", n, 3)
		}
		p.report("prune", 7, -1)
		p.finish()
		s := out.String()
		if strings.Contains(s, "133%") || strings.Contains(s, "4/3") || strings.Contains(s, "5/3") {
			t.Errorf("tty %t: over 100 %%:\n%q", tty, s)
		}
		if !strings.Contains(s, "redrive: 3/3 (100%)") || !strings.Contains(s, "redrive: 5\n") || !strings.Contains(s, "prune: 7\n") {
			t.Errorf("tty %t: %q", tty, s)
		}
		if !tty && strings.Contains(s, "\r") {
			t.Errorf("not a terminal, yet redrawn in place: %q", s)
		}
		if tty && !strings.Contains(s, "\r") {
			t.Errorf("a terminal, yet not redrawn in place: %q", s)
		}
	}
}

// migrate says which migrations it applied, and that there was nothing to
// apply the second time.
func TestMigrateSaysWhatItApplied(t *testing.T) {
	t.Setenv("FIFOBOX_REDRIVE_FUNCTION", "")
	db := pgtest.NewEmpty(t)
	out, errOut, err := runCLI(t, "--database-url", db.URL, "migrate")
	if err != nil || !regexp.MustCompile(`^applied \d+ migrations \(00001_outbox.sql, 00002_inbox.sql, .*\): schema at version \d+ \(audit #1\)\n$`).MatchString(out) {
		t.Fatalf("first migrate: %q %v %s", out, err, errOut)
	}
	out, _, err = runCLI(t, "--database-url", db.URL, "migrate")
	if err != nil || !regexp.MustCompile(`^schema at version \d+: nothing to apply \(audit #2\)\n$`).MatchString(out) {
		t.Fatalf("second migrate: %q %v", out, err)
	}
}

// On a terminal, a discard shows its dry run and asks; anything but y
// changes nothing, y runs it, --yes does not ask.
func TestDiscardAsksOnATerminal(t *testing.T) {
	f := &fakeLambda{respond: func(w http.ResponseWriter) {
		_, _ = w.Write([]byte(`{"operation":"dlq-discard","affected":1,"message":"would discard 1 messages from the DLQ of shipping"}`))
	}}
	lambdaEnv(t, f)
	run := func(answer string, args ...string) (string, error) {
		var out, errOut bytes.Buffer
		a := &app{out: &out, errOut: &errOut, in: strings.NewReader(answer), interactive: true}
		root := a.rootCmd()
		root.SetArgs(append([]string{"--via-lambda", "fn", "dlq", "discard", "--consumer", "shipping", "--group", "order-2", "--reason", "test data"}, args...))
		err := root.ExecuteContext(context.Background())
		return errOut.String(), err
	}
	errOut, err := run("n\n")
	if err == nil || !strings.Contains(err.Error(), "cancelled: nothing changed") || !strings.Contains(errOut, "go ahead") {
		t.Fatalf("answered n: %v\n%s", err, errOut)
	}
	if len(f.payloads) != 1 || f.payloads[0]["dry_run"] != true {
		t.Fatalf("answered n: invoked with %v, want only the dry run", f.payloads)
	}
	if _, err := run("y\n"); err != nil {
		t.Fatal(err)
	}
	if len(f.payloads) != 3 || f.payloads[1]["dry_run"] != true || f.payloads[2]["dry_run"] != nil {
		t.Fatalf("answered y: invoked with %v, want the dry run, then the discard", f.payloads)
	}
	if _, err := run("", "--yes"); err != nil || len(f.payloads) != 4 || f.payloads[3]["dry_run"] != nil {
		t.Fatalf("--yes: %v, invoked with %v", err, f.payloads)
	}
}
