package cli

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/spf13/cobra"

	"github.com/fifobox/fifobox/pkg/redrive"
)

// groupShort describes the commands that only group operations.
var groupShort = map[string]string{
	"dead": "Inspect, requeue or discard dead outbox events",
	"dlq":  "Look at a consumer's dead-letter queue and discard chosen messages (redrive moves them back)",
}

// addOperations adds a command for every operation of redrive.Ops: its
// words, help and flags come from the operation's schema, and its flags
// become the JSON the redrive Lambda reads (DecodeCommand), so the CLI and
// the Lambda accept the same operations and arguments.
func (a *app) addOperations(root *cobra.Command) {
	parents := map[string]*cobra.Command{}
	for _, spec := range redrive.Ops {
		c := a.opCommand(spec)
		if len(spec.Command) == 1 {
			root.AddCommand(c)
			continue
		}
		p, ok := parents[spec.Command[0]]
		if !ok {
			p = &cobra.Command{Use: spec.Command[0], Short: groupShort[spec.Command[0]]}
			parents[spec.Command[0]] = p
			root.AddCommand(p)
		}
		p.AddCommand(c)
	}
}

func (a *app) opCommand(spec redrive.OpSpec) *cobra.Command {
	var yes bool
	long := spec.Long
	if long == "" {
		long = spec.Short + "."
	}
	long += fmt.Sprintf("\n\nWith --via-lambda it runs in the redrive Lambda as {\"operation\": %q, ...}, the flags\nin snake_case (durations in seconds).", spec.Name)
	c := &cobra.Command{
		Use:     spec.Command[len(spec.Command)-1],
		Short:   spec.Short,
		Long:    long,
		Example: spec.Example,
		Args:    cobra.NoArgs,
		RunE: func(cc *cobra.Command, _ []string) error {
			cmd, err := commandFromFlags(cc, spec)
			if err != nil {
				return a.fail(spec.Name, redrive.FlagError(err))
			}
			if spec.Confirm && !cmd.DryRun && !yes && a.interactive {
				if err := a.confirm(cc.Context(), cmd); err != nil {
					return a.fail(spec.Name, err)
				}
			}
			return a.do(cc.Context(), cmd)
		},
	}
	f := c.Flags()
	for _, name := range spec.Args {
		arg, _ := redrive.ArgSpec(name)
		doc := arg.Doc
		for _, r := range spec.Required {
			if r == name {
				doc += " (required)"
			}
		}
		switch arg.Kind {
		case redrive.KindString, redrive.KindDuration, redrive.KindTime:
			f.String(arg.Flag, "", doc)
		case redrive.KindStrings:
			f.StringSlice(arg.Flag, nil, doc)
		case redrive.KindInt:
			f.Int(arg.Flag, 0, doc)
		case redrive.KindBool:
			f.Bool(arg.Flag, false, doc)
		}
	}
	if spec.Confirm {
		f.BoolVarP(&yes, "yes", "y", false, "do not ask for confirmation on a terminal")
	}
	return c
}

// commandFromFlags turns the flags given into the operation's JSON and
// decodes it as the redrive Lambda does.
func commandFromFlags(cc *cobra.Command, spec redrive.OpSpec) (redrive.Command, error) {
	payload := map[string]any{"operation": spec.Name}
	f := cc.Flags()
	for _, name := range spec.Args {
		arg, _ := redrive.ArgSpec(name)
		fl := f.Lookup(arg.Flag)
		if fl == nil || !fl.Changed {
			continue
		}
		var err error
		switch arg.Kind {
		case redrive.KindString, redrive.KindDuration, redrive.KindTime:
			payload[name], err = f.GetString(arg.Flag)
		case redrive.KindStrings:
			payload[name], err = f.GetStringSlice(arg.Flag)
		case redrive.KindInt:
			payload[name], err = f.GetInt(arg.Flag)
		case redrive.KindBool:
			payload[name], err = f.GetBool(arg.Flag)
		}
		if err != nil {
			return redrive.Command{}, err
		}
	}
	raw, err := json.Marshal(payload)
	if err != nil {
		return redrive.Command{}, err
	}
	return redrive.DecodeCommand(raw, "")
}

// confirm shows what cmd would do (its dry run) and asks before it runs.
func (a *app) confirm(ctx context.Context, cmd redrive.Command) error {
	dry := cmd
	dry.DryRun = true
	res, err := a.run(ctx, dry)
	if err != nil {
		return redrive.FlagError(err)
	}
	a.printText(res)
	if res.Affected == 0 {
		return errors.New("nothing to do")
	}
	fmt.Fprintf(a.errOut, "%s: go ahead (it cannot be undone)? [y/N] ", cmd.Operation)
	line, _ := bufio.NewReader(a.in).ReadString('\n')
	if ans := strings.ToLower(strings.TrimSpace(line)); ans != "y" && ans != "yes" {
		return errors.New("cancelled: nothing changed")
	}
	return nil
}

// do runs cmd and prints its result; a failure is printed (with --json,
// also as JSON on stdout) and returned, so the command exits 1.
func (a *app) do(ctx context.Context, cmd redrive.Command) error {
	res, err := a.run(ctx, cmd)
	a.prog.finish()
	if err != nil {
		if res.Operation == "" {
			res.Operation = cmd.Operation
		}
		if res.DLQ != nil || res.Affected > 0 {
			// What was done before the failure still counts.
			a.printResult(res)
		}
		return a.fail(cmd.Operation, redrive.FlagError(err))
	}
	a.printResult(res)
	if res.Status != nil && res.Status.State != redrive.StateOK {
		return statusError(res.Status)
	}
	return nil
}

// fail reports err for op as JSON too when --json is set.
func (a *app) fail(op string, err error) error {
	if a.jsonOut {
		enc := json.NewEncoder(a.out)
		enc.SetIndent("", "  ")
		_ = enc.Encode(map[string]string{"operation": op, "state": "failed", "error": err.Error()})
	}
	return err
}

// statusError names every section of st that could not be read, and each
// consumer's reason in full (consumers failing alike once).
func statusError(st *redrive.Status) error {
	var parts []string
	add := func(name string, s redrive.Section) {
		if !s.OK() {
			parts = append(parts, fmt.Sprintf("%s %s: %s", name, s.State, s.Error))
		}
	}
	add("outbox", st.Outbox.Section)
	add("errors", st.Errors.Section)
	if !st.Queues.OK() && len(consumerErrors(st.Queues.Consumers)) == 0 {
		add("queues", st.Queues.Section)
	}
	for _, ce := range consumerErrors(st.Queues.Consumers) {
		parts = append(parts, fmt.Sprintf("queues of %s %s: %s", strings.Join(ce.consumers, ", "), ce.state, ce.err))
	}
	return fmt.Errorf("status is %s: %s", st.State, strings.Join(parts, "; "))
}

type consumerError struct {
	consumers  []string
	state, err string
}

// consumerErrors groups the consumers whose queues could not be read by
// their reason.
func consumerErrors(qs []redrive.QueueDepth) []consumerError {
	var out []consumerError
	for _, q := range qs {
		if q.State == redrive.StateOK || q.State == redrive.StateNone || q.Error == "" {
			continue
		}
		i := slices.IndexFunc(out, func(c consumerError) bool { return c.err == q.Error && c.state == q.State })
		if i < 0 {
			out = append(out, consumerError{state: q.State, err: q.Error})
			i = len(out) - 1
		}
		out[i].consumers = append(out[i].consumers, q.Consumer)
	}
	return out
}
