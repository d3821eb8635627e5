package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/aws/aws-lambda-go/lambda"
	"github.com/aws/aws-lambda-go/lambdacontext"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	lambdaredrive "github.com/fifobox/fifobox/pkg/lambdafn/redrive"
	"github.com/fifobox/fifobox/pkg/redrive"
)

// processes are the CLI's commands that are not operations of the redrive
// Lambda: they run here, or are cobra's own.
var processes = []string{"provision", "capture", "consume", "dispatch", "help", "completion"}

// operationCommands maps each operation command of the CLI to its words.
func operationCommands(root *cobra.Command) map[string]*cobra.Command {
	out := map[string]*cobra.Command{}
	var walk func(c *cobra.Command, words []string)
	walk = func(c *cobra.Command, words []string) {
		for _, sub := range c.Commands() {
			w := append(slices.Clone(words), sub.Name())
			if len(words) == 0 && slices.Contains(processes, sub.Name()) {
				continue
			}
			if sub.HasSubCommands() {
				walk(sub, w)
				continue
			}
			out[strings.Join(w, "-")] = sub
		}
	}
	walk(root, nil)
	return out
}

// sample is a valid value for each argument, as a flag takes it.
var sample = map[string]string{
	"consumer": "shipping", "event_ids": "0193c1f4-1c2d-7000-8000-000000000001", "aggregate_type": "order", "aggregate_ids": "o-1",
	"since": "2026-10-01", "until": "2026-11-01T12:00:00Z", "dry_run": "true", "max": "5", "limit": "7", "reason": "poison",
	"from": "dlq", "groups": "o-1", "aggregates": "order/o-1", "messages": "0193c1f4-1c2d-7000-8000-000000000002",
	"error": "NotFoundException", "older_than": "7d", "inbox_older_than": "720h",
}

// The CLI and the redrive Lambda accept exactly the same operations and
// arguments: every operation command of the CLI is an operation of the
// schema and the other way round, each command's flags are its
// operation's arguments, and every argument given as a flag reaches the
// Lambda handler (through aws-lambda-go's handler) as the same command; a
// field the operation does not take is refused by the handler.
func TestLambdaAcceptsExactlyTheCLIsOperations(t *testing.T) {
	a := &app{out: io.Discard, errOut: io.Discard}
	cmds := operationCommands(a.rootCmd())
	var names []string
	for _, o := range redrive.Ops {
		names = append(names, o.Name)
	}
	var got []string
	for n := range cmds {
		got = append(got, n)
	}
	sort.Strings(got)
	sort.Strings(names)
	if !slices.Equal(got, names) {
		t.Fatalf("the CLI's operation commands %v, the Lambda's operations %v", got, names)
	}
	rec := &recorderExec{}
	h, err := lambdaredrive.New(rec, lambdaredrive.Config{})
	if err != nil {
		t.Fatal(err)
	}
	invoke := lambda.NewHandler(h)
	ctx := lambdacontext.NewContext(context.Background(), &lambdacontext.LambdaContext{AwsRequestID: "req-1"})
	for _, spec := range redrive.Ops {
		t.Run(spec.Name, func(t *testing.T) {
			c := cmds[spec.Name]
			var flags []string
			c.LocalFlags().VisitAll(func(f *pflag.Flag) {
				if f.Name != "yes" && f.Name != "help" {
					flags = append(flags, f.Name)
				}
			})
			var want []string
			for _, arg := range spec.Args {
				as, ok := redrive.ArgSpec(arg)
				if !ok {
					t.Fatalf("argument %s is not declared", arg)
				}
				want = append(want, as.Flag)
				if err := c.Flags().Set(as.Flag, sample[arg]); err != nil {
					t.Fatalf("--%s %s: %v", as.Flag, sample[arg], err)
				}
			}
			sort.Strings(flags)
			sort.Strings(want)
			if !slices.Equal(flags, want) {
				t.Fatalf("flags %v, want the operation's arguments %v", flags, want)
			}
			cliCmd, err := commandFromFlags(c, spec)
			if err != nil {
				t.Fatalf("the CLI refused every argument set: %v", err)
			}
			if err := cliCmd.Validate(); err != nil {
				t.Fatalf("validate: %v", err)
			}
			payload, _ := cliCmd.JSON()
			var fields map[string]any
			_ = json.Unmarshal(payload, &fields)
			if len(fields) != len(spec.Args)+1 {
				t.Fatalf("payload %s: want the operation and its %d arguments", payload, len(spec.Args))
			}
			rec.got = nil
			if _, err := invoke.Invoke(ctx, payload); err != nil {
				t.Fatalf("the Lambda refused %s: %v", payload, err)
			}
			if len(rec.got) != 1 {
				t.Fatalf("the Lambda ran %d commands", len(rec.got))
			}
			lambdaCmd := rec.got[0]
			lambdaCmd.RequestID, lambdaCmd.Actor = "", "" // what the Lambda adds
			a, _ := cliCmd.JSON()
			b, _ := lambdaCmd.JSON()
			if !bytes.Equal(a, b) {
				t.Fatalf("the CLI built %s, the Lambda ran %s", a, b)
			}
			// An argument of another operation, or a misspelt one, is refused by name.
			for _, extra := range []string{"older_thn", otherArg(spec)} {
				fields[extra] = "x"
				bad, _ := json.Marshal(fields)
				delete(fields, extra)
				if _, err := invoke.Invoke(ctx, bad); err == nil || !strings.Contains(err.Error(), extra) {
					t.Fatalf("the Lambda accepted %s (%v)", bad, err)
				}
			}
		})
	}
}

// otherArg is an argument the operation does not take.
func otherArg(spec redrive.OpSpec) string {
	for _, a := range []string{"older_than", "consumer", "event_ids"} {
		if !spec.Takes(a) {
			return a
		}
	}
	return "limit"
}

type recorderExec struct{ got []redrive.Command }

func (r *recorderExec) Execute(_ context.Context, cmd redrive.Command) (redrive.Result, error) {
	r.got = append(r.got, cmd)
	return redrive.Result{Operation: cmd.Operation}, nil
}
