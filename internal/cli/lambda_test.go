package cli

import (
	"io"
	"log/slog"
	"strings"
	"testing"

	"github.com/fifobox/fifobox/internal/emulatortest"
	"github.com/fifobox/fifobox/internal/invoketest"
	"github.com/fifobox/fifobox/internal/pgtest"
	lambdaredrive "github.com/fifobox/fifobox/pkg/lambdafn/redrive"
	"github.com/fifobox/fifobox/pkg/redrive"
	"github.com/fifobox/fifobox/pkg/topology"
	"github.com/fifobox/fifobox/pkg/transport/sns"
)

// lambdaFor serves the redrive function's real handler, over a real
// service (the test's schema, its own queues on the emulator).
func lambdaFor(t *testing.T) *invoketest.Server {
	t.Helper()
	db := pgtest.New(t)
	topo := topology.Default()
	env := emulatortest.New(t, topo, 0)
	q := sns.Queues{}
	for name, r := range env.Queues {
		q[name] = sns.QueueURLs{QueueURL: r.URL, DLQURL: r.DLQURL, SubscriptionDLQURL: r.SubDLQURL}
	}
	tr, err := sns.New(sns.Config{SNS: env.SNS, SQS: env.SQS, Queues: q, Topology: &topo})
	if err != nil {
		t.Fatal(err)
	}
	ops, _ := tr.Operations()
	svc, err := redrive.New(db.Pool, redrive.Config{Operations: ops, Transport: "sns", Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	h, err := lambdaredrive.New(svc, lambdaredrive.Config{})
	if err != nil {
		t.Fatal(err)
	}
	srv := invoketest.New(t, h.Invoke)
	lambdaEndpoint(t, srv.URL)
	return srv
}

// Every operation runs through the redrive Lambda's handler from the CLI
// (--via-lambda), audit included: status with its sections, a dry run that
// is audited, the audit that shows it, the DLQ listing.
func TestOperationsThroughTheLambda(t *testing.T) {
	srv := lambdaFor(t)
	run := func(args ...string) string {
		t.Helper()
		out, errOut, err := runCLI(t, append([]string{"--via-lambda", "fifobox-redrive", "--actor", "ana@laptop"}, args...)...)
		if err != nil {
			t.Fatalf("%v: %v\n%s", args, err, errOut)
		}
		return out
	}
	if out := run("status"); !strings.Contains(out, "queues (sns)") || !strings.Contains(out, "shipping           ok") {
		t.Fatalf("status:\n%s", out)
	}
	if out := run("retry-now", "--dry-run"); !strings.Contains(out, "would make 0 backing-off aggregates (0 events) due now (audit #") {
		t.Fatalf("retry-now:\n%s", out)
	}
	if out := run("prune", "--older-than", "7d", "--inbox-older-than", "30d", "--dry-run"); !strings.Contains(out, "older than 7d") {
		t.Fatalf("prune:\n%s", out)
	}
	out := run("audit")
	if !strings.Contains(out, "retry-now") || !strings.Contains(out, "claimed:ana@laptop") || !strings.Contains(out, `{"older_than":604800,"inbox_older_than":2592000}`) {
		t.Fatalf("audit through the Lambda:\n%s", out)
	}
	if out := run("dlq", "list", "--consumer", "shipping"); !strings.Contains(out, "dlq of shipping: 0 messages") {
		t.Fatalf("dlq list:\n%s", out)
	}
	// Refused by the handler, named by its field; by the CLI, by its flag.
	if _, _, err := runCLI(t, "--via-lambda", "fifobox-redrive", "dlq", "discard", "--consumer", "shipping", "--group", "g"); err == nil ||
		!strings.Contains(err.Error(), "--reason: required") {
		t.Fatalf("discard without a reason: %v", err)
	}
	if n := len(srv.Payloads()); n != 5 {
		t.Fatalf("%d invocations, want 5 (the refused one never left the CLI)", n)
	}
}
