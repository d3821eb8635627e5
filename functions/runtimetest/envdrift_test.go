package runtimetest

import (
	"bytes"
	"encoding/json"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/fifobox/fifobox/pkg/envspec"
	"github.com/fifobox/fifobox/pkg/transport/sns"
)

// jsonVars are variables holding JSON, by the type that decodes them: every
// key the template writes must be a field that type reads.
var jsonVars = map[string]func() any{
	"FIFOBOX_QUEUES": func() any { return &sns.Queues{} },
}

// pendingKeys are JSON keys the CDK app already writes for a reader that is
// being built in parallel. Each entry is removed once its reader lands (the
// test fails when a pending key is read already).
var pendingKeys = map[string]map[string]string{}

// The environment CDK gives each function (AWS and local variants) is
// exactly what the function's loaders read: every required variable set, no
// variable that nothing reads, nothing the platform reserves, every value
// accepted by the loader, and removing any variable either leaves the
// function able to start or fails its init with an error naming it.
func TestTemplateEnvironmentMatchesLoaders(t *testing.T) {
	for _, v := range variants {
		variant := v.dir
		t.Run(filepath.Base(variant), func(t *testing.T) {
			fns, tpl := functions(t, loadTemplates(t, variant))
			for _, bin := range v.functions {
				found := false
				for _, f := range fns {
					found = found || f.Binary == bin
				}
				if !found {
					t.Errorf("no %s function in %s", bin, variant)
				}
			}
			for _, key := range sortedKeys(fns) {
				f := fns[key]
				t.Run(key, func(t *testing.T) { checkFunctionEnv(t, tpl, f) })
			}
		})
	}
}

func checkFunctionEnv(t *testing.T, tpl template, f templateFunction) {
	spec, ok := functionSpecs[f.Binary]
	if !ok {
		t.Fatalf("function %s runs bootstrap %q, which functionSpecs does not know", f.ID, f.Binary)
	}
	resolved := map[string]string{}
	for _, name := range sortedKeys(f.Env) {
		v, ok := spec.env.Lookup(name)
		switch {
		case !ok:
			t.Errorf("sets %s, which nothing in the %s binary reads (it reads %s)", name, f.Binary, strings.Join(spec.env.Names(), ", "))
			continue
		case v.Reserved:
			t.Errorf("sets %s, which Lambda sets itself", name)
			continue
		}
		s, err := resolve(tpl, f.Env[name], placeholders)
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		resolved[name] = s
	}
	for _, v := range spec.env {
		if _, set := f.Env[v.Name]; v.Required && !set {
			t.Errorf("does not set %s, which the %s binary requires (%s)", v.Name, f.Binary, v.Doc)
		}
	}
	for name, newValue := range jsonVars {
		if s, ok := resolved[name]; ok {
			checkJSONKeys(t, name, s, newValue)
		}
	}

	setEnv(t, spec.env, resolved)
	if err := spec.load(); err != nil {
		t.Fatalf("the %s loaders reject the template's environment: %v", f.Binary, err)
	}
	for _, name := range sortedKeys(resolved) {
		decl, _ := spec.env.Lookup(name)
		t.Setenv(name, "")
		err := spec.load()
		t.Setenv(name, resolved[name])
		switch {
		case decl.Required && err == nil:
			t.Errorf("without %s the loaders still succeed, but it is declared required", name)
		case err != nil && !strings.Contains(err.Error(), name):
			t.Errorf("without %s the loaders fail with %q, which does not name it", name, err)
		}
	}
}

// setEnv clears every variable spec declares (the machine running the test
// may set some), sets what Lambda would set, then the function's own.
func setEnv(t *testing.T, spec envspec.Set, vars map[string]string) {
	t.Helper()
	for _, v := range spec {
		t.Setenv(v.Name, "")
	}
	t.Setenv("AWS_REGION", "us-east-1")
	t.Setenv("AWS_DEFAULT_REGION", "us-east-1")
	for k, v := range vars {
		t.Setenv(k, v)
	}
}

// checkJSONKeys decodes a JSON variable strictly into the type its loader
// decodes it into: a key the template writes but nothing reads fails.
func checkJSONKeys(t *testing.T, name, value string, newValue func() any) {
	t.Helper()
	var generic map[string]map[string]any
	if err := json.Unmarshal([]byte(value), &generic); err != nil {
		t.Errorf("%s is not a JSON object of objects: %v", name, err)
		return
	}
	pending := pendingKeys[name]
	for key, why := range pending {
		for _, obj := range generic {
			if _, ok := obj[key]; !ok {
				continue
			}
			dec := json.NewDecoder(strings.NewReader(`{"x":{"` + key + `":""}}`))
			dec.DisallowUnknownFields()
			if dec.Decode(newValue()) == nil {
				t.Errorf("%s key %q is read now: remove it from pendingKeys (%s)", name, key, why)
			}
			delete(obj, key)
		}
	}
	b, _ := json.Marshal(generic)
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(newValue()); err != nil {
		t.Errorf("%s holds something its reader does not read: %v", name, err)
	}
}

// Every os.Getenv / os.LookupEnv in the code a bootstrap links (this
// module's packages) names a variable declared for that function: a read
// of anything else is a variable CDK does not know to set. Only
// pkg/envspec reads names it is given.
func TestBinariesReadOnlyDeclaredVariables(t *testing.T) {
	root := repoRoot(t)
	const module = "github.com/fifobox/fifobox"
	for _, bin := range sortedKeys(functionSpecs) {
		t.Run(bin, func(t *testing.T) {
			spec := functionSpecs[bin].env
			cmd := exec.Command("go", "list", "-deps", "-tags", "lambda.norpc",
				"-f", "{{if not .Standard}}{{.ImportPath}}\t{{.Dir}}\t{{join .GoFiles \" \"}}{{end}}", "./functions/"+bin)
			cmd.Dir = root
			cmd.Env = append(os.Environ(), "GOOS=linux", "CGO_ENABLED=0")
			out, err := cmd.Output()
			if err != nil {
				t.Fatalf("go list: %v", err)
			}
			reads, pkgs := 0, 0
			for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
				parts := strings.SplitN(line, "\t", 3)
				if len(parts) != 3 || !strings.HasPrefix(parts[0], module) {
					continue
				}
				pkgs++
				for _, file := range strings.Fields(parts[2]) {
					reads += checkEnvReads(t, filepath.Join(parts[1], file), parts[0] == module+"/pkg/envspec", spec)
				}
			}
			if pkgs < 5 || reads == 0 {
				t.Fatalf("scanned %d packages and %d environment reads: is the scan broken?", pkgs, reads)
			}
		})
	}
}

// checkEnvReads reports reads of undeclared variables in one file and
// returns how many reads it found.
func checkEnvReads(t *testing.T, path string, isEnvspec bool, spec envspec.Set) int {
	t.Helper()
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
	if err != nil {
		t.Fatal(err)
	}
	osName := ""
	for _, imp := range f.Imports {
		if imp.Path.Value == `"os"` {
			osName = "os"
			if imp.Name != nil {
				osName = imp.Name.Name
			}
		}
	}
	if osName == "" {
		return 0
	}
	reads := 0
	ast.Inspect(f, func(n ast.Node) bool {
		call, ok := n.(*ast.CallExpr)
		if !ok {
			return true
		}
		sel, ok := call.Fun.(*ast.SelectorExpr)
		if !ok {
			return true
		}
		if x, ok := sel.X.(*ast.Ident); !ok || x.Name != osName {
			return true
		}
		pos := fset.Position(call.Pos())
		switch sel.Sel.Name {
		case "Getenv", "LookupEnv":
			reads++
			lit, ok := call.Args[0].(*ast.BasicLit)
			if !ok {
				if !isEnvspec {
					t.Errorf("%s: os.%s with a computed name: read through an envspec.Set so the variable is declared", pos, sel.Sel.Name)
				}
				return true
			}
			name, _ := strconv.Unquote(lit.Value)
			if _, ok := spec.Lookup(name); !ok {
				t.Errorf("%s reads %s, which is not declared for this function: add it to the loader's envspec.Set (and to functionSpecs if the loader is new)", pos, name)
			}
		case "Environ", "ExpandEnv", "Expand":
			t.Errorf("%s: os.%s reads variables no declaration lists", pos, sel.Sel.Name)
		}
		return true
	})
	return reads
}
