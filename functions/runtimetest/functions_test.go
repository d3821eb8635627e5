package runtimetest

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/fifobox/fifobox/pkg/awsclient"
	"github.com/fifobox/fifobox/pkg/db"
	"github.com/fifobox/fifobox/pkg/envspec"
	"github.com/fifobox/fifobox/pkg/lambdafn"
	"github.com/fifobox/fifobox/pkg/lambdafn/consumer"
	"github.com/fifobox/fifobox/pkg/lambdafn/dispatcher"
	lambdaredrive "github.com/fifobox/fifobox/pkg/lambdafn/redrive"
	"github.com/fifobox/fifobox/pkg/metrics"
	"github.com/fifobox/fifobox/pkg/readmodel"
	"github.com/fifobox/fifobox/pkg/transport"
)

// function is what one functions/<name>/main.go reads at init: the
// declared variables of every loader its setup calls, and those loaders run
// in the same order (without connecting to anything). When a main starts
// calling another loader, add it here; TestBinariesReadOnlyDeclaredVariables
// fails until its variables are declared.
type function struct {
	env  envspec.Set
	load func() error
}

var functionSpecs = map[string]function{
	"dispatcher": {
		env: envspec.Join(dispatcher.Env, db.Env, awsclient.Env, metrics.Env, lambdafn.Env, transport.RegisteredEnv()),
		load: func() error {
			if _, err := dispatcher.ConfigFromEnv(); err != nil {
				return err
			}
			t, err := openTransport()
			if err != nil {
				return err
			}
			if _, err := t.Publisher(); err != nil {
				return err
			}
			_, err = db.FromEnv()
			return err
		},
	},
	"consumer": {
		env: envspec.Join(consumer.Env, db.Env, awsclient.Env, metrics.Env, lambdafn.Env, transport.RegisteredEnv()),
		load: func() error {
			cfg, err := consumer.ConfigFromEnv()
			if err != nil {
				return err
			}
			t, err := openTransport()
			if err != nil {
				return err
			}
			if _, err := consumer.New(t, new(pgxpool.Pool), readmodel.ForConsumer(cfg.Consumer), nil, cfg); err != nil {
				return err
			}
			_, err = db.FromEnv()
			return err
		},
	},
	"redrive": {
		env: envspec.Join(lambdaredrive.Env, db.Env, awsclient.Env, lambdafn.Env, transport.RegisteredEnv()),
		load: func() error {
			if _, err := lambdaredrive.ConfigFromEnv(); err != nil {
				return err
			}
			t, err := openTransport()
			if err != nil {
				return err
			}
			if _, err := t.Operations(); err != nil {
				return err
			}
			if _, err := t.Provisioner(); err != nil {
				return err
			}
			_, err = db.FromEnv()
			return err
		},
	},
}

// openTransport is lambdafn.OpenTransport with a stand-in for Secrets
// Manager: it opens what the environment names without connecting.
func openTransport() (transport.Transport, error) {
	return transport.Open(context.Background(), transport.Options{Logger: slog.New(slog.DiscardHandler),
		Secret: func(context.Context, string) (string, error) {
			return `{"username":"fifobox","password":"secret"}`, nil
		}})
}

// repoRoot is the directory holding the application module's go.mod.
func repoRoot(tb testing.TB) string {
	tb.Helper()
	dir, err := os.Getwd()
	if err != nil {
		tb.Fatal(err)
	}
	for d := dir; d != filepath.Dir(d); d = filepath.Dir(d) {
		if _, err := os.Stat(filepath.Join(d, "go.mod")); err == nil {
			if _, err := os.Stat(filepath.Join(d, "functions")); err == nil {
				return d
			}
		}
	}
	tb.Fatalf("no repository root above %s", dir)
	return ""
}

// template is a synthesised CloudFormation template.
type template struct {
	Path      string
	Resources map[string]struct {
		Type       string         `json:"Type"`
		Properties map[string]any `json:"Properties"`
	} `json:"Resources"`
}

// templateFunction is one function of a template, found by its
// fifobox:function tag (infra/stacks.FunctionTag).
type templateFunction struct {
	Key     string // "dispatcher", "redrive", "consumer:<name>", "migration"
	Binary  string // the bootstrap it runs: dispatcher, consumer or redrive
	ID      string // logical id
	Env     map[string]any
	Timeout float64
	Memory  float64
}

// Synthesised templates, written by `make synth` (infra/scripts/synth.sh).
const (
	awsTemplates      = "infra/cdk.out"
	localTemplates    = "infra/cdk.out.local"
	rabbitmqTemplates = "infra/cdk.out.rabbitmq" // -c transport=rabbitmq (Amazon MQ)
	natsTemplates     = "infra/cdk.out.nats"     // -c transport=nats
)

// variants are the synthesised template sets and the functions each must
// have (NATS has no Lambda event source, so no consumer function).
var variants = []struct {
	dir       string
	functions []string
}{
	{awsTemplates, []string{"consumer", "dispatcher", "redrive"}},
	{localTemplates, []string{"consumer", "dispatcher", "redrive"}},
	{rabbitmqTemplates, []string{"consumer", "dispatcher", "redrive"}},
	{natsTemplates, []string{"dispatcher", "redrive"}},
}

// loadTemplates reads every *.template.json in dir (relative to the
// repository root). Missing templates skip the test, or fail it with
// FIFOBOX_REQUIRE_SYNTH=1.
func loadTemplates(tb testing.TB, dir string) []template {
	tb.Helper()
	root := repoRoot(tb)
	paths, _ := filepath.Glob(filepath.Join(root, dir, "*.template.json"))
	if len(paths) == 0 {
		msg := fmt.Sprintf("no synthesised templates in %s: run `make synth` first", dir)
		if os.Getenv("FIFOBOX_REQUIRE_SYNTH") == "1" {
			tb.Fatal(msg + " (FIFOBOX_REQUIRE_SYNTH=1)")
		}
		tb.Skip(msg)
	}
	warnIfStale(tb, root, paths[0])
	var out []template
	for _, p := range paths {
		b, err := os.ReadFile(p)
		if err != nil {
			tb.Fatal(err)
		}
		t := template{Path: p}
		if err := json.Unmarshal(b, &t); err != nil {
			tb.Fatalf("%s: %v", p, err)
		}
		out = append(out, t)
	}
	return out
}

// warnIfStale notes when the CDK sources changed after the synth: the test
// then checks an old template.
func warnIfStale(tb testing.TB, root, tplPath string) {
	tb.Helper()
	st, err := os.Stat(tplPath)
	if err != nil {
		return
	}
	for _, glob := range []string{"infra/stacks/*.go", "pkg/topology/*.go"} {
		srcs, _ := filepath.Glob(filepath.Join(root, glob))
		for _, s := range srcs {
			if fi, err := os.Stat(s); err == nil && fi.ModTime().After(st.ModTime().Add(time.Second)) {
				tb.Logf("warning: %s changed after %s was synthesised; run `make synth` to check the current template", s, tplPath)
				return
			}
		}
	}
}

// functions returns the fifobox functions of the templates by key.
func functions(tb testing.TB, tpls []template) (map[string]templateFunction, template) {
	tb.Helper()
	out := map[string]templateFunction{}
	var owner template
	for _, t := range tpls {
		for id, r := range t.Resources {
			if r.Type != "AWS::Lambda::Function" {
				continue
			}
			binary := ""
			tags, _ := r.Properties["Tags"].([]any)
			for _, tag := range tags {
				m, _ := tag.(map[string]any)
				if m["Key"] == "fifobox:function" {
					binary, _ = m["Value"].(string)
				}
			}
			if binary == "" {
				continue // a CDK-provided function (trigger provider, log retention)
			}
			env, _ := r.Properties["Environment"].(map[string]any)
			vars, _ := env["Variables"].(map[string]any)
			f := templateFunction{Key: binary, Binary: binary, ID: id, Env: vars}
			f.Timeout, _ = r.Properties["Timeout"].(float64)
			f.Memory, _ = r.Properties["MemorySize"].(float64)
			if binary == "consumer" {
				name, _ := vars["FIFOBOX_CONSUMER_NAME"].(string)
				f.Key = "consumer:" + name
			}
			if _, ok := vars["FIFOBOX_DB_SECRET_ARN"]; ok && binary == "redrive" {
				f.Key = "migration" // the redrive code as the database owner (AWS template only)
			}
			if _, dup := out[f.Key]; dup {
				tb.Fatalf("%s: two functions for %s", t.Path, f.Key)
			}
			out[f.Key] = f
			owner = t
		}
	}
	if len(out) == 0 {
		tb.Fatalf("no function tagged fifobox:function in %d templates", len(tpls))
	}
	return out, owner
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// resolver gives the value of a resource reference: attr "" for {"Ref": id},
// else {"Fn::GetAtt": [id, attr]}.
type resolver func(t template, id, attr string) (string, error)

// resolve renders a template value to the string the function would see,
// with references resolved by r. Intrinsics it does not know are an error:
// a new kind of value in a function's environment must be handled here
// deliberately.
func resolve(t template, v any, r resolver) (string, error) {
	switch x := v.(type) {
	case string:
		return x, nil
	case float64, bool:
		return fmt.Sprint(x), nil
	case map[string]any:
		if len(x) != 1 {
			break
		}
		if ref, ok := x["Ref"].(string); ok {
			switch ref {
			case "AWS::Region":
				return "us-east-1", nil
			case "AWS::AccountId":
				return "123456789012", nil
			case "AWS::Partition":
				return "aws", nil
			case "AWS::URLSuffix":
				return "amazonaws.com", nil
			}
			return r(t, ref, "")
		}
		if ga, ok := x["Fn::GetAtt"].([]any); ok && len(ga) == 2 {
			id, _ := ga[0].(string)
			attr, _ := ga[1].(string)
			return r(t, id, attr)
		}
		if j, ok := x["Fn::Join"].([]any); ok && len(j) == 2 {
			sep, _ := j[0].(string)
			parts, _ := j[1].([]any)
			out := make([]string, len(parts))
			for i, p := range parts {
				s, err := resolve(t, p, r)
				if err != nil {
					return "", err
				}
				out[i] = s
			}
			return strings.Join(out, sep), nil
		}
		// Fn::Select of Fn::Split: the first of a list attribute that
		// crossed stacks (the broker's AMQP endpoints).
		if sel, ok := x["Fn::Select"].([]any); ok && len(sel) == 2 {
			idx, _ := sel[0].(float64)
			if sp, ok := sel[1].(map[string]any)["Fn::Split"].([]any); ok && len(sp) == 2 {
				sep, _ := sp[0].(string)
				whole, err := resolve(t, sp[1], r)
				if err != nil {
					return "", err
				}
				if parts := strings.Split(whole, sep); int(idx) < len(parts) {
					return parts[int(idx)], nil
				}
			}
		}
		// A cross-stack reference (the stateful stack's proxy endpoint,
		// broker endpoint, broker secret).
		for _, k := range []string{"Fn::GetStackOutput", "Fn::ImportValue"} {
			if o, ok := x[k]; ok {
				name, _ := o.(map[string]any)["OutputName"].(string)
				if s, ok := o.(string); ok {
					name = s
				}
				return r(t, "output:"+name, "")
			}
		}
	}
	b, _ := json.Marshal(v)
	return "", fmt.Errorf("cannot resolve template value %s", b)
}

// placeholders resolves references to values of the right shape without
// any real resource: what the drift test feeds the loaders.
func placeholders(t template, id, attr string) (string, error) {
	if strings.HasPrefix(id, "output:") {
		switch {
		case strings.Contains(id, "BrokerAmqpEndpoints"):
			return "amqps://b-0123abcd.mq.us-east-1.amazonaws.com:5671", nil
		case strings.Contains(id, "BrokerSecret"):
			return "arn:aws:secretsmanager:us-east-1:123456789012:secret:BrokerSecret-AbCdEf", nil
		case strings.Contains(id, "BrokerArn"):
			return "arn:aws:mq:us-east-1:123456789012:broker:Fifobox-broker:b-0123abcd", nil
		}
		return "fifobox-proxy.proxy-abcdefghijkl.us-east-1.rds.amazonaws.com", nil
	}
	res, ok := t.Resources[id]
	if !ok {
		return "", fmt.Errorf("reference to %s, which the template does not define", id)
	}
	name := func(prop string) string {
		if n, ok := res.Properties[prop].(string); ok {
			return n
		}
		return strings.ToLower(id)
	}
	switch {
	case res.Type == "AWS::SQS::Queue" && attr == "":
		return "https://sqs.us-east-1.amazonaws.com/123456789012/" + name("QueueName"), nil
	case res.Type == "AWS::SQS::Queue" && attr == "Arn":
		return "arn:aws:sqs:us-east-1:123456789012:" + name("QueueName"), nil
	case res.Type == "AWS::SQS::Queue" && attr == "QueueName":
		return name("QueueName"), nil
	case res.Type == "AWS::SNS::Topic" && (attr == "" || attr == "TopicArn"):
		return "arn:aws:sns:us-east-1:123456789012:" + name("TopicName"), nil
	case res.Type == "AWS::SecretsManager::Secret" && attr == "": // a function's own broker user
		return "arn:aws:secretsmanager:us-east-1:123456789012:secret:" + id + "-AbCdEf", nil
	}
	return "", fmt.Errorf("no placeholder for %s (%s) attribute %q", id, res.Type, attr)
}
